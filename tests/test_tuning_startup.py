"""Start-up tuning on measured latencies: the quantum from a state budget, a
solver that cannot stall on slowly mixing chains, and a table that survives
one failed N.  Fast (a few seconds in all) and not timed."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from aiorouter.tuning.dtmc import solve_many
from aiorouter.tuning.inputs import LatencyModel, SystemSpec
from aiorouter.tuning.dtmc import choose_delta
from aiorouter.tuning.search import SolveCache, best_thresholds, threshold_table
from aiorouter.tuning.solve import SolverError
from aiorouter.tuning.tuner import Tuner, TunerConfig
from aiorouter.tuning.cli import main as cli_main
from test_tuning import R2R_C, R2R_L, R2R_P

# The bench pair: profiled L(b) = a + c*b, a slow large model at large batches.
BENCH_LAT = [LatencyModel(1.9e-3, 0.1e-3), LatencyModel(19.2e-3, 5.5e-3)]
ME3_P = [[0.5, 0.3, 0.2]] * 3
ME3_LAT = [LatencyModel(6e-3), LatencyModel(15e-3), LatencyModel(27.9e-3)]


@pytest.mark.parametrize("P,lat,cap,budget", [
    (R2R_P, BENCH_LAT, 6, 50_000),
    (ME3_P, ME3_LAT, 4, 20_000),
    ([[0.7, 0.3], [0.4, 0.6]], [LatencyModel(3e-3, 0.3e-3), LatencyModel(25e-3, 2e-3)], 6, 50_000),
])
def test_chosen_delta_keeps_the_table_under_budget(P, lat, cap, budget) -> None:
    choice = choose_delta(P, lat, cap, table_states=budget)
    M = len(P)
    spec = SystemSpec.build(P, np.ones((M, M)), lat, choice.delta)
    table = threshold_table(spec, cap, cache=SolveCache())
    states = sum(c.num_states for r in table.rows for c in r.candidates)
    assert states <= budget
    assert choice.table_states <= budget  # the estimate it chose by
    assert table[cap].candidates[0].B == (1,) * M
    assert table[cap].candidates[0].num_states == choice.largest_chain  # counted exactly
    # The reported rounding error is the true one.
    b = np.arange(1, cap + 1)
    L = np.array([m.a + m.c * b for m in lat])
    d = np.array([[m.quanta(int(x), choice.delta) for x in b] for m in lat])
    assert choice.max_error == pytest.approx(np.max(np.abs(d * choice.delta - L) / L), abs=1e-12)
    assert 0 <= choice.mean_error <= choice.max_error
    assert "states in the table" in choice.describe()


def test_exact_quantum_preferred() -> None:
    # 6.0 and 27.9 ms are both multiples of 0.3 ms: no rounding at all, and
    # the coarsest exact quantum (the chain is the same as at 0.1 ms).
    choice = choose_delta(R2R_P, R2R_L, 8)
    assert choice.delta == pytest.approx(0.3e-3, rel=1e-9)
    assert choice.max_error < 1e-9


def test_budget_forces_a_coarser_quantum() -> None:
    fine = choose_delta(R2R_P, BENCH_LAT, 6, table_states=200_000)
    coarse = choose_delta(R2R_P, BENCH_LAT, 6, table_states=20_000)
    assert coarse.delta > fine.delta and coarse.table_states <= 20_000


@pytest.mark.parametrize("kwargs,msg", [
    (dict(table_states=10), "table_states"),
    (dict(latencies=[6e-3]), "got 1 latencies for M = 2"),
    (dict(P=[[0.5, 0.4], [1, 0]]), "row 0 of P sums to 0.9"),
    (dict(max_concurrency=0), "N \\(concurrency\\)"),
])
def test_choose_delta_bad_input(kwargs, msg) -> None:
    args = dict(P=R2R_P, latencies=R2R_L, max_concurrency=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=msg):
        choose_delta(args.pop("P"), args.pop("latencies"), args.pop("max_concurrency"), **args)


def test_slope_pair_solves_without_error() -> None:
    # `aiorouter tune ... --delta-ms 0.15` used to stop with "stationary solve
    # did not converge in 50000 sweeps" from N = 10: one GMRES shared by a
    # batch of chains needed ~400 steps, and the power method it fell back
    # to crawls (the censored chain has eigenvalues -0.9994 and 0.9991).
    spec = SystemSpec.build(R2R_P, R2R_C, BENCH_LAT, 0.15e-3)
    res = best_thresholds(spec, 10, cache=SolveCache())
    assert res.best == (1, 8)
    assert res.best_throughput == pytest.approx(324.7088778, rel=1e-7)
    # Reference from the power method run to convergence (25k sweeps).
    assert res.throughput_of((1, 1)) == pytest.approx(306.0702428, rel=1e-7)


def test_one_failing_chain_is_retried_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiorouter.tuning.solve as solver

    spec = SystemSpec.build(R2R_P, R2R_C, BENCH_LAT, 0.15e-3)
    Bs = [(1, 1), (1, 3), (2, 2), (1, 6)]
    ref = solve_many(spec, 7, Bs)
    real, calls = solver.gmres, []

    def flaky(S, seg, u, *a, **k):  # the batch's first solve "fails" chain 1
        x, ok, it = real(S, seg, u, *a, **k)
        calls.append(k.get("restart"))
        if len(calls) == 1:
            ok[1] = False
            x[seg.cid == 1] = 0.0
        return x, ok, it

    monkeypatch.setattr(solver, "gmres", flaky)
    got = solve_many(spec, 7, Bs)
    assert calls == [None, 150]  # one retry, with the long restart
    for a, b in zip(got, ref):
        assert a.throughput == pytest.approx(b.throughput, rel=1e-7)


def test_tuner_keeps_previous_row_when_one_n_fails(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    import aiorouter.tuning.tuner as tuner_module

    real = tuner_module.threshold_table

    def failing_at_3(spec, n, **kw):
        if n == 3:
            raise SolverError("stationary solve did not converge (test)")
        return real(spec, n, **kw)

    monkeypatch.setattr(tuner_module, "threshold_table", failing_at_3)
    cfg = TunerConfig.build(R2R_P, R2R_C, R2R_L, 4, delta=0.3e-3)
    with caplog.at_level(logging.WARNING, logger="aiorouter.tuning"):
        tuner = Tuner(cfg)
    assert tuner.thresholds(3) == tuner.thresholds(2) == (1, 2)
    assert tuner.thresholds(4) == (1, 3)  # the rows after it are solved as usual
    assert "N=3: solve failed" in caplog.text and "using N=2's B=(1, 2)" in caplog.text


def test_cli_auto_and_explicit_delta(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--P", "0.65,0.35;1,0", "--C", "1,0;1,0", "--latency-ms", "6.0,27.9",
            "--concurrency", "1-3", "--no-progress"]
    assert cli_main(base + ["--delta-ms", "auto"]) == 0
    out = capsys.readouterr()
    assert "delta = 0.3 ms" in out.err and "delta=0.3 ms" in out.out
    assert cli_main(base + ["--delta-ms", "0.15"]) == 0  # explicit: honoured as given
    assert "delta=0.15 ms" in capsys.readouterr().out
    assert cli_main(base + ["--delta-ms", "fine"]) == 2
    assert "expected a number of ms or 'auto'" in capsys.readouterr().err
