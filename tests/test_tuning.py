"""Tests of aiorouter.tuning: the DTMC throughput model, search, simulator,
latency fit, online estimation, CLI and input validation."""

from __future__ import annotations

import itertools
import logging
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tuning_tools import compare_latency_models, simulate
from aiorouter.tuning.dtmc import solve_dtmc, solve_many, throughput
from aiorouter.tuning.inputs import Contention, LatencyModel, SystemSpec, fit_latency, is_feasible
from aiorouter.tuning.learned import RoutingEstimator
from aiorouter.tuning.search import SolveCache, best_thresholds, feasible_thresholds, threshold_table
from aiorouter.tuning.tuner import Tuner, TunerConfig
from aiorouter.tuning.cli import main as cli_main

R2R_P = [[0.65, 0.35], [1.0, 0.0]]
R2R_C = [[1.0, 0.0], [1.0, 0.0]]
R2R_L = [6.0e-3, 27.9e-3]
MS = 1e-3
REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------
# Model vs independent Monte Carlo simulator


def _random_case(rng: np.random.Generator, idx: int):
    M = 2 if idx % 2 == 0 else 3
    N = int(rng.integers(1, 7 if M == 2 else 5))
    P = rng.dirichlet(np.ones(M), size=M)
    if idx % 5 == 0:  # the last model never keeps a request (like R2R's large model)
        P[M - 1, M - 1] = 0.0
        P[M - 1] /= P[M - 1].sum()
    C = rng.choice([0.0, 1.0, 2.0], size=(M, M))
    C[:, 0] = np.maximum(C[:, 0], 1.0)  # some tokens are always committed
    if idx % 4 == 3:  # batch-dependent latency, exact multiples of 1 ms
        lat = [LatencyModel(a=int(rng.integers(2, 9)) * MS, c=int(rng.integers(0, 3)) * MS)
               for _ in range(M)]
    else:
        lat = [int(rng.integers(2, 13)) * MS for _ in range(M)]
    feas = feasible_thresholds(M, N)
    B = feas[int(rng.integers(len(feas)))]
    # delta = 1 ms: latencies are whole ms, so the quantised chain is exact and
    # stays small; the simulator runs in continuous time.
    spec = SystemSpec.build(P, C, lat, delta=1e-3)
    return spec, N, B


@pytest.mark.parametrize("idx", range(20))
def test_dtmc_matches_monte_carlo(idx: int) -> None:
    rng = np.random.default_rng(1000 + idx)
    spec, N, B = _random_case(rng, idx)
    model = solve_dtmc(spec, N, B)
    sim = simulate(spec, N, B, events=1500, warmup=150, replications=128, seed=idx)
    assert model.closed_classes == 1
    rel = abs(sim.throughput / model.throughput - 1)
    assert rel < 0.02, (spec, N, B, model.throughput, sim.throughput)
    # The simulator's own error bar is far tighter than the 2 % tolerance.
    assert sim.throughput_stderr / sim.throughput < 0.01


def test_by_products_match_monte_carlo() -> None:
    spec = SystemSpec.build([[0.5, 0.3, 0.2]] * 3, [[1, 1, 1]] * 3, [3 * MS, 7 * MS, 11 * MS],
                           delta=1e-3)
    model = solve_dtmc(spec, 4, (1, 2, 2))
    sim = simulate(spec, 4, (1, 2, 2), events=3000, replications=128, seed=7)
    for i in range(3):
        assert sim.utilisation[i] == pytest.approx(model.utilisation[i], rel=0.02)
        assert sim.mean_batch_size[i] == pytest.approx(model.mean_batch_size[i], rel=0.02)
        assert sim.admission_delay[i] == pytest.approx(model.admission_delay[i], rel=0.05, abs=2e-5)
    assert sim.expected_tau == pytest.approx(model.expected_tau, rel=0.02)
    assert sim.expected_tokens == pytest.approx(model.expected_tokens, rel=0.02)
    assert sim.mean_admission_delay == pytest.approx(model.mean_admission_delay, rel=0.05)


# --------------------------------------------------------------------------
# Closed-form cases


@pytest.mark.parametrize("N", [1, 3, 7])
def test_single_model_is_n_c_over_l(N: int) -> None:
    for B in range(1, N + 1):
        r = throughput([[1.0]], [[2.0]], [6.0e-3], N, (B,))
        assert r.throughput == pytest.approx(N * 2.0 / 6.0e-3, rel=1e-9)
        assert r.mean_batch_size == pytest.approx((N,))
        assert r.utilisation == pytest.approx((1.0,))
        assert r.mean_admission_delay == pytest.approx(0.0, abs=1e-12)


def test_single_model_batch_dependent_latency() -> None:
    lm = LatencyModel(a=4e-3, c=0.5e-3)
    r = throughput([[1.0]], [[1.0]], [lm], 6, (1,))
    assert r.throughput == pytest.approx(6 / lm(6), rel=1e-9)


def test_r2r_single_request_hand_formula() -> None:
    # One request alternates: T = 1 / (L0 + p L1) tokens per second.
    p = 0.35
    r = throughput(R2R_P, R2R_C, R2R_L, 1, (1, 1))
    assert r.throughput == pytest.approx(1.0 / (R2R_L[0] + p * R2R_L[1]), rel=1e-9)
    assert r.utilisation[0] == pytest.approx(R2R_L[0] / (R2R_L[0] + p * R2R_L[1]), rel=1e-9)


def test_periodic_two_model_ping_pong() -> None:
    # Both requests move together 0 -> 1 -> 0 ...: a periodic chain.
    r = throughput([[0, 1], [1, 0]], [[0, 1], [1, 0]], [5e-3, 15e-3], 2, (1, 1))
    assert r.throughput == pytest.approx(4 / 20e-3, rel=1e-9)
    assert r.utilisation == pytest.approx((0.25, 0.75), rel=1e-9)
    assert r.mean_batch_size == pytest.approx((2.0, 2.0))


def test_unused_model_reports_nan() -> None:
    r = throughput([[1, 0], [0.5, 0.5]], [[1, 0], [0, 1]], [4e-3, 9e-3], 3, (1, 1))
    assert r.throughput == pytest.approx(3 / 4e-3, rel=1e-9)
    assert math.isnan(r.mean_batch_size[1]) and math.isnan(r.admission_delay[1])
    assert r.utilisation[1] == 0.0


def test_reducible_chain_matches_simulator() -> None:
    # Models 1 and 2 absorb: several closed classes are reachable from the start.
    P = [[0.5, 0.25, 0.25], [0, 1, 0], [0, 0, 1]]
    spec = SystemSpec.build(P, [[1, 1, 1]] * 3, [5e-3, 10e-3, 20e-3], delta=1e-3)
    r = solve_dtmc(spec, 2, (1, 1, 1))
    assert r.closed_classes > 1
    sim = simulate(spec, 2, (1, 1, 1), events=300, warmup=60, replications=4096, seed=3)
    assert sim.throughput == pytest.approx(r.throughput, rel=0.02)


def test_paper_r2r_thresholds() -> None:
    # The paper fixes B0 = 1 and varies B1 at N = 2, 3, 4.
    best = {N: best_thresholds(SystemSpec.build(R2R_P, R2R_C, R2R_L), N, cache=SolveCache()).best
            for N in (2, 3, 4)}
    assert best == {2: (1, 2), 3: (1, 2), 4: (1, 3)}


# --------------------------------------------------------------------------
# Search and feasibility


@pytest.mark.parametrize("M,N", [(1, 5), (2, 6), (3, 4), (4, 3)])
def test_feasible_set_is_exactly_the_rule(M: int, N: int) -> None:
    brute = [B for B in itertools.product(range(1, N + 1), repeat=M) if sum(b - 1 for b in B) < N]
    assert sorted(feasible_thresholds(M, N)) == sorted(brute)
    assert len(feasible_thresholds(M, N)) == math.comb(N - 1 + M, M)


@pytest.mark.parametrize("P,C,L,N", [
    (R2R_P, R2R_C, R2R_L, 5),
    ([[0.5, 0.3, 0.2]] * 3, [[1] * 3] * 3, [6e-3, 15e-3, 27.9e-3], 3),
    ([[0.7, 0.3, 0.0], [0.4, 0.4, 0.2], [0.5, 0.0, 0.5]], [[1, 0, 0], [1, 1, 0], [1, 0, 2]],
     [3e-3, 8e-3, 20e-3], 4),
])
def test_search_equals_brute_force(P, C, L, N) -> None:
    spec = SystemSpec.build(P, C, L, delta=1e-3 if len(P) == 3 else 1e-4)
    res = best_thresholds(spec, N, cache=SolveCache())
    brute = {B: solve_dtmc(spec, N, B).throughput
             for B in itertools.product(range(1, N + 1), repeat=spec.M) if is_feasible(B, N)}
    assert is_feasible(res.best, N)
    assert all(is_feasible(c.B, N) for c in res.candidates)
    assert {c.B for c in res.candidates} == set(brute)
    assert res.best_throughput == pytest.approx(max(brute.values()), rel=1e-7)
    assert brute[res.best] == pytest.approx(max(brute.values()), rel=1e-7)
    for c in res.candidates:  # batched solves equal one-at-a-time solves
        assert c.throughput == pytest.approx(brute[c.B], rel=1e-7)


def test_table_every_n_and_cache_hits() -> None:
    spec = SystemSpec.build(R2R_P, R2R_C, R2R_L)
    cache = SolveCache()
    t1 = threshold_table(spec, 6, cache=cache)
    assert t1.concurrencies == (1, 2, 3, 4, 5, 6)
    for row in t1.rows:
        assert is_feasible(row.best, row.N)
        assert len(row.candidates) == len(feasible_thresholds(2, row.N))
        assert row.best_throughput == max(c.throughput for c in row.candidates)
    misses = cache.misses
    t2 = threshold_table(spec, 6, cache=cache)
    assert cache.misses == misses and cache.hits >= sum(len(r.candidates) for r in t1.rows)
    assert [r.best for r in t2.rows] == [r.best for r in t1.rows]


def test_parallel_search_equals_serial() -> None:
    spec = SystemSpec.build([[0.5, 0.3, 0.2]] * 3, [[1] * 3] * 3, [6e-3, 15e-3, 27.9e-3],
                           delta=1e-3)
    serial = best_thresholds(spec, 5, cache=SolveCache(), workers=1)
    import aiorouter.tuning.search as search

    old = search.PARALLEL_MIN_STATES
    search.PARALLEL_MIN_STATES = 0
    try:
        par = best_thresholds(spec, 5, cache=SolveCache(), workers=2)
    finally:
        search.PARALLEL_MIN_STATES = old
    assert par.best == serial.best
    assert [c.throughput for c in par.candidates] == pytest.approx(
        [c.throughput for c in serial.candidates], rel=1e-7)


# --------------------------------------------------------------------------
# Latency model


def test_fit_latency_recovers_line() -> None:
    rng = np.random.default_rng(0)
    b = np.repeat(np.arange(1, 17), 5)
    y = 4e-3 + 0.3e-3 * b + rng.normal(0, 2e-5, b.size)
    lm = fit_latency(b, y)
    assert lm.a == pytest.approx(4e-3, rel=0.02)
    assert lm.c == pytest.approx(0.3e-3, rel=0.02)


def test_fit_latency_clamps_and_rejects() -> None:
    assert fit_latency([1, 2, 4], [5e-3, 4.9e-3, 4.8e-3]).c == 0.0  # no negative slope
    assert fit_latency([1, 2, 4], [1e-3, 3e-3, 7e-3]).a == 0.0  # no negative intercept
    # The clamped fits are the constrained least-squares optima: the mean, and the line through 0.
    assert fit_latency([1, 2, 4], [5e-3, 4.9e-3, 4.8e-3]).a == pytest.approx(np.mean([5e-3, 4.9e-3, 4.8e-3]), rel=1e-12)
    b, y = np.array([1.0, 2.0, 4.0]), np.array([1e-3, 3e-3, 7e-3])
    assert fit_latency(b, y).c == pytest.approx(b @ y / (b @ b), rel=1e-12)
    with pytest.raises(ValueError, match="at least 2 points"):
        fit_latency([4], [1e-3])
    with pytest.raises(ValueError, match="distinct batch sizes"):
        fit_latency([4, 4], [1e-3, 2e-3])


def test_batch_dependent_latency_changes_prediction() -> None:
    const = throughput(R2R_P, R2R_C, [LatencyModel(6e-3), LatencyModel(27.9e-3)], 4, (1, 3))
    vary = throughput(R2R_P, R2R_C, [LatencyModel(5.9e-3, 0.1e-3), LatencyModel(27.4e-3, 0.5e-3)],
                      4, (1, 3))
    assert vary.throughput < const.throughput * 0.99  # bigger batches are slower
    table = compare_latency_models(R2R_P, R2R_C,
                                   [LatencyModel(5.9e-3, 0.1e-3), LatencyModel(27.4e-3, 0.5e-3)], 4)
    assert len(table.rows) == len(feasible_thresholds(2, 4))
    row = next(r for r in table.rows if r.B == (1, 3))
    assert row.constant == pytest.approx(const.throughput, rel=1e-7)
    assert row.batch_dependent == pytest.approx(vary.throughput, rel=1e-7)
    assert all(r.batch_dependent <= r.constant * (1 + 1e-9) for r in table.rows)


# --------------------------------------------------------------------------
# Online estimation and the tuner


def test_routing_estimator_converges_and_detects_drift() -> None:
    template = np.array([[0.65, 0.35], [1.0, 0.0]])
    true = np.array([[0.8, 0.2], [0.9, 0.1]])
    est = RoutingEstimator(template, R2R_C, prior_strength=50)
    assert np.allclose(est.estimate(), template)
    assert not est.drifted(template, 0.01)
    rng = np.random.default_rng(1)
    for i in range(2):
        dst = (rng.random(20000) < true[i, 1]).astype(int)
        est.observe_many(np.full(dst.size, i), dst, tokens=np.where(dst == 0, 1.0, 0.5))
    assert np.abs(est.estimate() - true).max() < 0.01
    assert est.drifted(template, 0.05)
    assert not est.drifted(true, 0.02)
    assert est.estimate_C()[0, 1] == pytest.approx(0.5, abs=0.01)
    assert est.estimate().sum(axis=1) == pytest.approx([1.0, 1.0])
    est.observe(1, 0, tokens=1.0)
    assert est.observations == 40001
    with pytest.raises(ValueError):
        est.observe(2, 0)


def test_tuner_resolves_on_drift(caplog: pytest.LogCaptureFixture) -> None:
    cfg = TunerConfig.build(R2R_P, R2R_C, R2R_L, 4, delta=1e-3, min_new_observations=100,
                            drift_margin=0.05, prior_strength=20)
    with caplog.at_level(logging.INFO, logger="aiorouter.tuning"):
        tuner = Tuner(cfg)
    assert "B* (start) N=4" in caplog.text and "tokens/s" in caplog.text
    before = [tuner.thresholds(N) for N in range(1, 5)]
    assert tuner.thresholds(9) == tuner.thresholds(4)
    assert tuner.maybe_resolve() is False  # no data yet
    rng = np.random.default_rng(2)
    for _ in range(2000):  # the small model now hands off 80 % of the time
        tuner.observe(0, int(rng.random() < 0.8))
        tuner.observe(1, 0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="aiorouter.tuning"):
        assert tuner.maybe_resolve() is True
    assert "re-solving" in caplog.text
    assert abs(tuner.solved_P[0, 1] - 0.8) < 0.05
    after = [tuner.thresholds(N) for N in range(1, 5)]
    assert after != before  # the optimum moved with P
    assert tuner.maybe_resolve() is False  # no new data since


def test_tuner_resolves_when_the_step_cost_moves_the_step_times() -> None:
    """The runtime's work around each step (measured while serving) is a per-step cost: one that
    moves a model's step time by more than cost_margin re-solves with L + cost, with no routing
    drift; one inside the margin does not."""
    cfg = TunerConfig.build(R2R_P, R2R_C, R2R_L, 4, delta=1e-3, cost_margin=0.02)
    tuner = Tuner(cfg)
    small_cost = [LatencyModel(0.05e-3, 0.002e-3), LatencyModel(0.1e-3, 0.0)]  # < 2% of 6 ms and of 27.9 ms
    assert tuner.propose(np.zeros((2, 2)), step_cost=small_cost) is None
    cost = [LatencyModel(1e-3, 0.05e-3), LatencyModel(1e-3, 0.05e-3)]  # a quantum (1 ms) more per step
    p = tuner.propose(np.zeros((2, 2)), step_cost=cost)
    assert p is not None and p.cost_moved and not p.drift.drifted
    assert p.solved.latency == tuner.with_step_cost(cost)
    assert p.solved.latency[0](1) == pytest.approx(7.05e-3)
    np.testing.assert_array_equal(p.solved.P, tuner.solved_P)  # the routing stays what it was solved for
    plain = [r.best_throughput for r in tuner.table.rows]
    slower = [r.best_throughput for r in p.solved.table.rows]
    assert all(s < q for s, q in zip(slower, plain))  # longer steps: fewer tokens/s at every N
    tuner.adopt(p)
    assert tuner.last is p and tuner.latency == p.solved.latency
    assert tuner.propose(np.zeros((2, 2)), step_cost=cost) is None  # solved with it now
    with pytest.raises(ValueError, match="step_cost has 1 models"):
        tuner.with_step_cost(cost[:1])


def test_step_cost_service_fits_the_loop_work_per_step() -> None:
    from aiorouter.tuning.service import MIN_STEP_SAMPLES, TuningService

    from aiorouter.tuning.learned import StepSpan

    svc = TuningService(["small", "large"], (np.array(R2R_P), np.array(R2R_C)), 4, 4, lambda t, m: None)
    rng = np.random.default_rng(0)
    for k in range(MIN_STEP_SAMPLES):
        b = int(rng.integers(1, 5))
        svc.observe_step(0, StepSpan(k, k + 0.5, b, b), 0.2e-3 + 0.05e-3 * b + rng.normal(0, 1e-6))
        if k < MIN_STEP_SAMPLES - 1:
            svc.observe_step(1, StepSpan(k + 0.5, k + 1, 1, 1), 0.3e-3)
    assert svc.step_costs() is None  # the large model is one step short
    svc.observe_step(1, StepSpan(1e4, 1e4 + 1, 1, 1), 0.3e-3)
    small, large = svc.step_costs()
    assert small.a == pytest.approx(0.2e-3, rel=0.05) and small.c == pytest.approx(0.05e-3, rel=0.05)
    assert large.a == pytest.approx(0.3e-3) and large.c == 0.0  # one batch size: its mean


# --------------------------------------------------------------------------
# CLI


CLI_ARGS = ["--P", "0.65,0.35;1,0", "--C", "1,0;1,0", "--latency-ms", "6.0,27.9",
            "--concurrency", "1-4", "--no-progress"]


def test_cli_prints_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(CLI_ARGS) == 0
    out = capsys.readouterr().out
    for N, best in [(1, "(1, 1)"), (2, "(1, 2)"), (3, "(1, 2)"), (4, "(1, 3)")]:
        assert f"N={N:<3d} B*={best}" in out
    assert "tokens/s" in out and "(2, 3)" in out  # every candidate is listed


def test_cli_batch_dependent_latency(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(CLI_ARGS[:-3] + ["--concurrency", "3", "--latency-slope-ms", "0.1,0.5",
                                     "--no-progress"]) == 0
    assert "27.4+0.5*b ms" in capsys.readouterr().out


@pytest.mark.parametrize("args,msg", [
    (["--P", "0.6,0.35;1,0"], "row 0 of P sums to 0.95"),
    (["--C", "1,0,0;1,0,0"], "shape"),
    (["--latency-ms", "6.0"], "latencies for M = 2"),
    (["--latency-ms", "6.0,-1"], "non-negative"),
    (["--concurrency", "0-3"], "concurrency"),
    (["--P", "a,b;1,0"], "cannot parse"),
])
def test_cli_bad_input(args, msg, capsys: pytest.CaptureFixture[str]) -> None:
    argv = list(CLI_ARGS)
    for i in range(0, len(args), 2):
        argv[argv.index(args[i]) + 1] = args[i + 1]
    assert cli_main(argv) != 0
    assert msg in capsys.readouterr().err


def test_cli_as_module() -> None:
    proc = subprocess.run([sys.executable, "-m", "aiorouter.tuning.cli", *CLI_ARGS[:-3],
                           "--concurrency", "2", "--no-progress"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "N=2   B*=(1, 2)" in proc.stdout


# --------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize("kwargs,msg", [
    (dict(P=[[0.5, 0.4], [1, 0]]), r"row 0 of P sums to 0\.9"),
    (dict(P=[[0.5, 0.5], [0.2, 0.7]]), r"row 1 of P sums to 0\.9"),
    (dict(P=[[1.0, 0.0, 0.0], [1, 0, 0]]), "square"),
    (dict(C=[[1, 0, 0], [1, 0, 0], [1, 0, 0]]), "C has shape"),
    (dict(L=[6e-3]), "got 1 latencies for M = 2"),
    (dict(L=[6e-3, -1e-3]), "non-negative"),
    (dict(P=[[1.2, -0.2], [1, 0]]), "not a probability"),
    (dict(N=0), r"N \(concurrency\) must be >= 1"),
    (dict(B=(3, 3)), r"sum\(B_i - 1\) < N"),
    (dict(B=(1, 2, 1)), "M = 2"),
    (dict(B=(0, 1)), "outside 1..N"),
    (dict(delta=0.0), "delta"),
])
def test_bad_input_raises_value_error(kwargs, msg) -> None:
    args = dict(P=R2R_P, C=R2R_C, L=R2R_L, N=4, B=(1, 2), delta=1e-4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=msg):
        throughput(args["P"], args["C"], args["L"], args["N"], args["B"], delta=args["delta"])


def test_negative_latency_model_rejected() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        LatencyModel(a=-1e-3, c=0.0)


def test_state_limit_stops_early() -> None:
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"max_states = 20,000.*coarser delta"):
        throughput([[0.5, 0.3, 0.2]] * 3, [[1] * 3] * 3, [6e-3, 15e-3, 27.9e-3], 8, (1, 1, 1),
                   max_states=20_000)
    assert time.perf_counter() - t0 < 5.0  # the full chain would take far longer


def test_search_reports_state_limit() -> None:
    spec = SystemSpec.build(R2R_P, R2R_C, R2R_L)
    with pytest.raises(ValueError, match="max_states"):
        best_thresholds(spec, 12, max_states=500, cache=SolveCache())


def test_solve_many_equals_solve_dtmc() -> None:
    spec = SystemSpec.build(R2R_P, R2R_C, R2R_L)
    Bs = feasible_thresholds(2, 5)
    many = solve_many(spec, 5, Bs)
    for B, r in zip(Bs, many):
        one = solve_dtmc(spec, 5, B)
        assert r.B == B and r.num_states == one.num_states
        assert r.throughput == pytest.approx(one.throughput, rel=1e-7)
        assert r.mean_admission_delay == pytest.approx(one.mean_admission_delay, rel=1e-7)


# --------------------------------------------------------------------------
# Solver internals: the shortcuts it takes must be safe


def _chain(P, L, N, B, delta=1e-3):
    from aiorouter.tuning.statespace import enumerate_chains
    from aiorouter.tuning.inputs import quanta_unit

    spec = SystemSpec.build(P, np.ones_like(np.asarray(P)), L, delta)
    d = spec.quanta_table(N)
    u = quanta_unit(d)
    return spec, enumerate_chains(spec.p_array(), d // u, u, N, [tuple(B)], 10**6), d // u


def test_one_class_shortcut_agrees_with_graph_search() -> None:
    from aiorouter.tuning.solve import closed_classes, surely_one_class

    rng = np.random.default_rng(5)
    claimed = 0
    for k in range(40):
        M = 2 + k % 2
        P = rng.dirichlet(np.ones(M), size=M)
        P[rng.random((M, M)) < 0.3] = 0.0  # sparse routing: the rule must often say "unsure"
        for i in range(M):
            if P[i].sum() == 0:
                P[i, i] = 1.0
        P /= P.sum(axis=1, keepdims=True)
        N = int(rng.integers(2, 5))
        feas = feasible_thresholds(M, N)
        B = feas[int(rng.integers(len(feas)))]
        spec, cb, _ = _chain(P, [int(rng.integers(2, 9)) * MS for _ in range(M)], N, B)
        if surely_one_class(spec.p_array(), [B]):
            claimed += 1
            assert closed_classes(cb)[0] == 1, (P, N, B)
    assert 5 <= claimed < 40  # the rule fires, but not vacuously everywhere


def test_power_fallback_equals_gmres(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiorouter.tuning.solve as solver

    spec = SystemSpec.build([[0.5, 0.3, 0.2]] * 3, [[1] * 3] * 3, [3 * MS, 7 * MS, 11 * MS],
                           delta=1e-3)
    ref = solve_dtmc(spec, 4, (1, 2, 1))
    def failing(S, seg, u, *a, **k):  # every chain "fails": the power method must take over
        return np.zeros_like(u), np.zeros(seg.nB, dtype=bool), 0

    monkeypatch.setattr(solver, "gmres", failing)
    fallback = solve_dtmc(spec, 4, (1, 2, 1))
    assert fallback.throughput == pytest.approx(ref.throughput, rel=1e-7)
    assert fallback.utilisation == pytest.approx(ref.utilisation, rel=1e-6)


def test_nearly_decomposable_chain_is_solved_by_the_tight_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain from a cpu-tiny start-up profile (contention measured; bench.run --quick) whose first
    GMRES solution met the residual test with entries of -7e-6, and on which the power method then
    ran for 20 minutes in a router's start-up solve. The retry at a tighter tolerance must solve it,
    without the power method, to the censored chain's exact stationary vector (a dense solve)."""
    import aiorouter.tuning.solve as solver
    from aiorouter.tuning.solve import solver_blocks, solver_order
    from aiorouter.tuning.statespace import enumerate_chains
    from aiorouter.tuning.dtmc import DEFAULT_TOL, chain_inputs
    from aiorouter.tuning.inputs import check_thresholds

    kappa = [(1, 1, 0, 1, 0.39), (0, 1, 1, 1, 0.07), (1, 1, 0, 8, 0.35), (0, 8, 1, 1, 0.14),
             (1, 16, 0, 1, 0.35), (0, 1, 1, 16, 0.12), (1, 16, 0, 8, 0.34), (0, 8, 1, 16, 0.07)]
    spec = SystemSpec.build([[0.65, 0.35], [1.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]],
                           [LatencyModel(4.113e-3, 0.1249e-3), LatencyModel(62.377e-3, 3.9416e-3)],
                           0.00037414207397839605, Contention.build(2, kappa))
    N, B = 13, (1, 2)
    first = []
    real_fixed = solver.fixed_points

    def checked(*a):
        ok = real_fixed(*a)
        first.append(bool(ok.all()))
        return ok

    def no_power(*a, **k):
        raise AssertionError("the power method ran")

    monkeypatch.setattr(solver, "fixed_points", checked)
    monkeypatch.setattr(solver, "power", no_power)
    d_units, unit, kap, rmax = chain_inputs(spec, N)
    cb = enumerate_chains(spec.p_array(), d_units, unit, N, [check_thresholds(B, 2, N)], 10**6, kappa=kap, rmax=rmax)
    pi, _, _ = solver.stationary_batch(cb, d_units, tol=DEFAULT_TOL, P=spec.p_array())
    assert first == [False, True]  # the first GMRES answer is refused; the retry's is taken
    # Reference: the chain censored to its feedback states F, built column by column and solved densely.
    order, nY, levels = solver_order(cb, d_units)
    assert levels is None  # contended: SuperLU's kernel
    pos = np.empty(cb.n, dtype=np.int64)
    pos[order] = np.arange(cb.n)
    lower, A_F = solver_blocks(cb, order, pos, nY)
    nF = cb.n - nY
    S = np.stack([lower.solve(A_F @ e)[nY:] for e in np.eye(nF)], axis=1)  # [nF, nF], column-stochastic
    A = S - np.eye(nF)
    A[0] = 1.0
    ref = np.linalg.solve(A, np.eye(nF)[0])  # [nF]
    got = pi[order[nY:]]
    assert np.abs(got / got.sum() - ref).sum() < 1e-5


def test_f_states_break_every_cycle() -> None:
    # Solver order is [Y, F]: Y -> Y transitions must go strictly forward in it.
    from aiorouter.tuning.solve import solver_order

    spec, cb, d_units = _chain([[0.5, 0.3, 0.2]] * 3, [3 * MS, 7 * MS, 11 * MS], 4, (1, 1, 1))
    order, nY, levels = solver_order(cb, d_units)
    assert sorted(order) == list(range(cb.n))
    pos = np.empty(cb.n, dtype=np.int64)
    pos[order] = np.arange(cb.n)
    ps, pd = pos[cb.src], pos[cb.dst]
    yy = (ps < nY) & (pd < nY)
    assert yy.sum() > cb.src.size // 2  # most transitions are inside the DAG
    assert np.all(pd[yy] > ps[yy])
    assert 0 < cb.n - nY < cb.n // 3
    # Y's levels: they tile Y, and every Y source's transitions leave its level for a later one.
    assert levels[0] == 0 and levels[-1] == nY and np.all(np.diff(levels) > 0)
    assert 10 < levels.size < nY // 10  # far fewer levels than states: the point of them
    level = np.repeat(np.arange(levels.size - 1), np.diff(levels))
    ys = ps < nY
    beyond = pd[ys] >= nY
    assert np.all(beyond | (level[np.minimum(pd[ys], nY - 1)] > level[ps[ys]]))


def test_latency_quanta_at_least_one() -> None:
    assert LatencyModel(a=1e-6).quanta(1, 1e-4) == 1
    assert LatencyModel(a=6e-3, c=1e-4).quanta(4, 1e-4) == 64


def test_tuning_package_imports_no_torch_or_engines() -> None:
    # Static check (importing aiorouter.tuning runs aiorouter/__init__, which
    # belongs to the runtime): no module of the tuning package may import them.
    import ast

    pkg = REPO / "aiorouter" / "tuning"
    files = sorted(pkg.glob("*.py"))
    assert len(files) >= 10
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            else:
                continue
            for m in mods:
                assert not m.split(".")[0] in {"torch", "engines", "policies", "server"}, (f, m)


@pytest.mark.parametrize("bits,span", [(2, 5000), (14, 5000), (3, 2**62 - 1)])
def test_state_index_matches_a_dict(bits, span) -> None:
    # The BFS's hash index: a tiny first table forces its slot collisions (overflow), its growth
    # and its overflow's re-placing; keys up to 2^62 exercise the hashing of large keys.
    from aiorouter.tuning.statespace import HashIndex

    rng = np.random.default_rng(5)
    index, ref, overflowed = HashIndex(bits=bits), {}, 0
    assert (index.lookup(np.array([3, 9], dtype=np.int64)) == -1).all()
    for _ in range(30):  # BFS-like levels: look a batch up, insert the new keys (sorted, distinct)
        keys = rng.integers(0, span, 300).astype(np.int64)
        keys[:50] = keys[50:100]  # repeats within a level
        if ref:
            keys[100:150] = rng.choice(np.array(list(ref), dtype=np.int64), 50)  # keys seen before
        got = index.lookup(keys)
        assert got.dtype == np.int32 and got.tolist() == [ref.get(int(k), -1) for k in keys]
        new = np.unique(keys[got < 0])
        ids = index.insert_new(new)
        ref.update({int(k): int(i) for k, i in zip(new, ids)})
        overflowed = max(overflowed, index.over.size)
    assert index.size == len(ref) and sorted(ref.values()) == list(range(len(ref)))
    assert overflowed > 0 or span < 2**32  # random keys collide (small consecutive ones need not)
    everything = np.array(list(ref), dtype=np.int64)
    assert index.lookup(everything).tolist() == list(ref.values())


def test_bfs_ids_are_levels_in_key_order_and_parts_join() -> None:
    # State ids: level by level from the start states, each level's new states in key order; the
    # transitions are kept per level (dst_parts / prob_parts) and `dst` / `prob` join them.
    from aiorouter.tuning.solve import solver_blocks, solver_order
    from aiorouter.tuning.statespace import Encoder

    spec, cb, d_units = _chain([[0.5, 0.3, 0.2]] * 3, [3 * MS, 7 * MS, 11 * MS], 4, (1, 2, 1))
    assert cb.level_starts[0] == 0 and cb.level_starts[-1] == cb.n
    assert len(cb.dst_parts) == len(cb.prob_parts) == cb.level_starts.size - 1
    assert np.array_equal(cb.dst, np.concatenate(cb.dst_parts)) and cb.dst.dtype == np.int32
    assert np.array_equal(cb.prob, np.concatenate(cb.prob_parts))
    level = np.repeat(np.arange(cb.level_starts.size - 1), np.diff(cb.level_starts))
    assert np.all(level[cb.dst] <= level[cb.src] + 1)  # a BFS: targets at most one level further
    first = np.full(cb.n, cb.n)
    np.minimum.at(first, cb.dst, level[cb.src] + 1)
    first[0] = 0
    assert np.array_equal(first, level)  # each state is in the level that first reached it
    enc = Encoder(3, 4, cb.rmax)
    key = cb.cid * np.int64(enc.space)
    for j in range(3):
        key += enc.code(j, cb.K[:, j], cb.Bt[:, j], cb.R[:, j])
    for a, b in zip(cb.level_starts[:-1], cb.level_starts[1:]):
        assert np.all(np.diff(key[a:b]) > 0)  # distinct states, each level in key order
    # The solver's matrices against a plain construction from the joined arrays, in both layouts:
    # SuperLU's (I - T^T, unit diagonal first) and the level solver's (T^T's strictly lower part).
    from aiorouter.tuning.solve import LevelSolver, UnitLowerSolver

    order, nY, levels = solver_order(cb, d_units)
    pos = np.empty(cb.n, dtype=np.int32)
    pos[order] = np.arange(cb.n, dtype=np.int32)
    for lv, kind, diag, sign in ((None, UnitLowerSolver, 1, -1.0), (levels, LevelSolver, 0, 1.0)):
        lower, A_F = solver_blocks(cb, order, pos, nY, lv)
        assert type(lower) is kind
        data, idx, ptr = [], [], [0]
        for j, s in enumerate(order):
            run = slice(cb.indptr[s], cb.indptr[s + 1])
            data.append([1.0] * diag + ([] if j >= nY else list(sign * cb.prob[run])))
            idx.append([j] * diag + ([] if j >= nY else list(pos[cb.dst[run]])))
            ptr.append(ptr[-1] + len(data[-1]))
        assert np.array_equal(lower.data, np.concatenate(data))
        assert np.array_equal(lower.indices, np.concatenate(idx)) and np.array_equal(lower.indptr, ptr)
        F = [slice(cb.indptr[s], cb.indptr[s + 1]) for s in order[nY:]]
        assert np.array_equal(A_F.data, np.concatenate([cb.prob[r] for r in F]))
        assert np.array_equal(A_F.indices, np.concatenate([pos[cb.dst[r]] for r in F]))
        assert np.array_equal(A_F.indptr, np.cumsum([0] + [r.stop - r.start for r in F]))
    # Levels that do not hold (all of Y as one level): the level solver refuses them, SuperLU's serves.
    lower, _ = solver_blocks(cb, order, pos, nY, np.array([0, nY]))
    assert type(lower) is UnitLowerSolver


@pytest.mark.parametrize("kernel", ["gstrs", "splu"])
def test_unit_lower_solver_solves_with_either_kernel(kernel, monkeypatch) -> None:
    import scipy.sparse as sp

    import aiorouter.tuning.solve as solver

    if kernel == "splu":  # as when scipy's private triangular kernel is gone or wrong
        monkeypatch.setattr(solver, "gstrs_kernel", lambda: None)
    else:
        assert solver.gstrs_kernel() is not None  # this scipy still has it: the fast path runs
    n = 400
    L = (sp.tril(sp.random(n, n, density=0.02, random_state=2), k=-1) * -0.5 + sp.identity(n)).tocsc()
    L.sort_indices()  # diagonal first in each column (it is the smallest row of a lower column)
    b = np.random.default_rng(2).random(n)
    x = solver.UnitLowerSolver(L.data, L.indices, L.indptr).solve(b.copy())
    assert np.allclose(L @ x, b, rtol=1e-12, atol=1e-12)


def test_level_solver_solves_and_refuses_levels_that_do_not_hold() -> None:
    # x = (I - E)^-1 b level by level, for a random strictly lower E whose columns fall into
    # levels of 1-40 columns with no entry inside a level; the same E with one entry moved into its
    # own level is refused (levelled() is False), and solver_blocks then takes SuperLU's layout.
    import scipy.sparse as sp

    from aiorouter.tuning.solve import LevelSolver, csc_matvec_kernel

    assert csc_matvec_kernel() is not None  # this scipy has the kernel: the level path runs
    rng = np.random.default_rng(4)
    n = 600
    levels = np.unique(np.concatenate([[0, n], np.cumsum(rng.integers(1, 40, n))]))
    levels = levels[levels <= n]
    level = np.repeat(np.arange(levels.size - 1), np.diff(levels))
    E = sp.random(n, n, density=0.03, random_state=4, format="coo")
    below = level[E.row] > level[E.col]  # only entries in a later level
    E = sp.csc_matrix((E.data[below] * 0.3, (E.row[below], E.col[below])), shape=(n, n))
    E.sort_indices()
    b = rng.random(n)
    x = LevelSolver(E.data, E.indices.astype(np.intc), E.indptr.astype(np.intc), levels).solve(b.copy())
    assert LevelSolver(E.data, E.indices, E.indptr, levels).levelled()
    assert np.allclose(x - E @ x, b, rtol=1e-12, atol=1e-12)
    ref = sp.linalg.spsolve_triangular((sp.identity(n) - E).tocsr(), b, lower=True)
    assert np.allclose(x, ref, rtol=1e-12, atol=1e-12)
    j = int(np.flatnonzero(np.diff(levels) > 1)[0])  # a level of two columns or more
    s = int(levels[j])
    bad = E.tolil()
    bad[s + 1, s] = 0.1  # an entry inside level j
    bad = bad.tocsc()
    assert not LevelSolver(bad.data, bad.indices, bad.indptr, levels).levelled()
