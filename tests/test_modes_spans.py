"""bench.modes_spans reads a --keep-spans run back: windows told apart by gaps, each window's speed
against the start-up profile, and the served refit's step-time error on every run."""
import gzip
import json

import pytest

from bench.modes_spans import main, profile_ratio, report, windows_of

COST_MS = {"small": {"a": 2.0, "per_seq": 0.5, "per_token": 0.25}, "large": {"a": 20.0, "per_seq": 2.0, "per_token": 1.0}}


def cost(name: str, batch: int, tokens: int) -> float:
    c = COST_MS[name]
    return 1e-3 * (c["a"] + c["per_seq"] * batch + c["per_token"] * tokens)


def sync_spans(start: float, steps: int, slow: float, large_batch=lambda k: 2) -> dict[str, list]:
    """The two models stepping one after the other (never overlapping), each step `slow` x its cost."""
    out: dict[str, list] = {"small": [], "large": []}
    t = start
    for k in range(steps):
        for name, b in (("small", 1), ("large", large_batch(k))):
            dt = slow * cost(name, b, 3 * b)
            out[name].append([t, t + dt, b, 3 * b])
            t += dt
    return out


def write_run(tmp_path, runs: dict[str, dict]) -> None:
    profile = {"step_cost_ms": COST_MS, "contention": [], "threads": {"small": 1, "large": 2},
               "profile_s": {"step_cost": 1.0, "contention": 0.0}}  # as PairProfile.describe() writes it
    (tmp_path / "modes.json").write_text(json.dumps({"profile": profile}))
    with gzip.open(tmp_path / "spans.json.gz", "wt") as f:
        json.dump({"2": runs}, f)


def test_windows_split_on_gaps_and_read_their_speed_against_the_profile():
    a, b = sync_spans(0.0, 60, 1.2), sync_spans(10.0, 60, 2.0)
    ws = windows_of(a["large"] + b["large"], gap=1.5)
    assert [len(w) for w in ws] == [60, 60]
    from aiorouter.tuning import StepCost
    large = StepCost(*(1e-3 * COST_MS["large"][k] for k in ("a", "per_seq", "per_token")))
    assert [profile_ratio(w, large) for w in ws] == pytest.approx([1.2, 2.0])
    # a model idle for longer than the gap inside a window: the windows are where any model ran
    small = [x for k, x in enumerate(a["small"]) if not 10 <= k < 50]  # ~1.6 s without a small step
    assert len(windows_of(small, gap=1.5)) == 2
    assert [len(w) for w in windows_of(small, 1.5, small + a["large"])] == [20]


def test_report_reads_every_window_and_the_refit_error_of_every_run(tmp_path):
    # sync and eager at 1.3x the profile (the refit learns it); a sweep point of other batch sizes
    # at 1.3x too (the refit predicts it), and one at 1.3x in one window and 2.6x in the other
    vary = lambda k: 1 + k % 4  # noqa: E731
    sync = sync_spans(0.0, 80, 1.3, vary)
    eager = sync_spans(20.0, 80, 1.3, lambda k: 1 + (k + 1) % 4)
    point = sync_spans(40.0, 80, 1.3, lambda k: 3)
    slow = {m: sync_spans(60.0, 40, 1.3, lambda k: 3)[m] + sync_spans(80.0, 40, 2.6, lambda k: 3)[m] for m in ("small", "large")}
    idle = {"small": point["small"], "large": []}  # the large model never stepped in it
    write_run(tmp_path, {"sync@2": sync, "eager@2": eager, "sweep 1,3": point, "sweep 1,2": slow, "sweep 1,4": idle})
    text = report(tmp_path, gap=1.5)
    assert "| sweep 1,2 | large | 1.30x 2.60x | 3.0 |" in text
    assert "| sync@2 | small | 1.30x | 1.0 |" in text
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if "%" in line}
    assert rows["sweep 1,3"].count("+0 %") + rows["sweep 1,3"].count("-0 %") == 2  # both models predicted
    # the slow window took twice as long: the refit (1.3x) is a third short of the whole point
    assert "-33 %" in rows["sweep 1,2"]
    assert "| sweep 1,4 | large | - | - |" in text and rows["sweep 1,4"].endswith("| - |")


def test_a_run_without_spans_is_refused_with_the_flag_to_use(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path)])
    assert e.value.code == 2 and "--keep-spans" in capsys.readouterr().err
