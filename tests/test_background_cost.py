"""`python -m bench.dtmc_validation background`: a step timed alone and beside bursts of other work, on a real torch op."""
import pytest
import torch

from bench.dtmc_validation import BURSTS_MS, background_cost, main, median_step_ms


def test_every_team_and_condition_is_timed_against_the_step_alone():
    a = torch.randn(256, 256)
    res = background_cost(lambda: a @ a, [1], seconds=0.2)
    row = res["1"]
    assert set(row) == {"alone"} | {f"{k} {ms:g}/2 ms" for k in ("python", "gil_free") for ms in BURSTS_MS}
    assert row["alone"]["over_alone"] == 1.0
    for v in row.values():
        assert v["step_ms"] > 0 and v["over_alone"] == pytest.approx(v["step_ms"] / row["alone"]["step_ms"])


def test_a_failing_step_is_reported_not_timed():
    def step():
        raise ValueError("no step")
    with pytest.raises(RuntimeError, match="the model's step failed: ValueError\\('no step'\\)"):
        median_step_ms(step, 1, 0.05)


def test_bad_arguments_name_the_problem(capsys):
    with pytest.raises(SystemExit) as e:
        main(["background", "--threads", "0"])
    assert e.value.code == 2 and "every --threads must be >= 1" in capsys.readouterr().err
