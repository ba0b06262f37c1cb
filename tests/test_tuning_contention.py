"""The throughput model with models that share hardware (contention), step-sync and eager as
candidates, and re-solving on routing drift. Fast (seconds) and not timed."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from tuning_tools import simulate
from aiorouter.tuning.dtmc import solve_dtmc
from aiorouter.tuning.inputs import Contention, LatencyModel, SystemSpec
from aiorouter.tuning.learned import routing_drift
from aiorouter.tuning.schedules import choose_schedule, sync_throughput
from aiorouter.tuning.search import SolveCache, best_thresholds, solve_grid
from aiorouter.tuning.tuner import Tuner, TunerConfig
from test_tuning import R2R_C, R2R_L, R2R_P

MS = 1e-3


def _flat(M: int, k: float) -> Contention:
    """kappa = k between every ordered pair, at every batch size."""
    return Contention.build(M, [(i, 1, j, 1, k) for i in range(M) for j in range(M) if i != j])


# --------------------------------------------------------------------------
# Zero contention is the old chain


def test_zero_contention_is_the_old_chain_on_figure_10() -> None:
    plain = SystemSpec.build(R2R_P, R2R_C, R2R_L)
    zero = Contention.build(2, [(1, 1, 0, 1, 0.0), (0, 1, 1, 1, 0.0)])
    assert SystemSpec.build(R2R_P, R2R_C, R2R_L, contention=zero).contention is None  # same solve
    # ... and forced through the contention code path (charges, one-quantum units, the F test
    # for climbing residuals), the chain is the same: same states, same throughput.
    forced = dataclasses.replace(plain, contention=zero)
    for N in (2, 3, 4):
        Bs = [(1, b) for b in range(1, N + 1)]
        old, new = solve_grid(plain, N, Bs), solve_grid(forced, N, Bs)
        for o, n in zip(old, new):
            assert n.num_states == o.num_states
            assert n.throughput == pytest.approx(o.throughput, rel=1e-9)
            assert n.mean_batch_size == pytest.approx(o.mean_batch_size, rel=1e-9)
        assert max(new, key=lambda r: r.throughput).B == max(old, key=lambda r: r.throughput).B
    best = {N: best_thresholds(forced, N, cache=SolveCache()).best for N in (2, 3, 4)}
    assert best == {2: (1, 2), 3: (1, 2), 4: (1, 3)}  # the paper's Figure 10


# --------------------------------------------------------------------------
# Chain against the simulator (which simulates rates, not the chain's charges)


@pytest.mark.parametrize("idx", range(8))
def test_contention_chain_matches_simulator(idx: int) -> None:
    rng = np.random.default_rng(500 + idx)
    P = rng.dirichlet(np.ones(2), size=2)
    C = np.array([[1.0, 0.0], [1.0, 1.0]])
    lat = [LatencyModel(int(rng.integers(1, 4)) * MS, 0.2 * MS * (idx % 2)),
           LatencyModel(int(rng.integers(8, 20)) * MS, 1.0 * MS * (idx % 2))]
    N = int(rng.integers(2, 6))
    # kappa per ordered pair, varying with both batch sizes on a 2 x 2 grid
    pts = [(i, bi, 1 - i, bj, float(rng.uniform(0.05, 0.6))) for i in (0, 1) for bi in (1, N) for bj in (1, N)]
    con = Contention.build(2, pts)
    spec = SystemSpec.build(P, C, lat, delta=0.1 * MS, contention=con)
    B = (1, int(rng.integers(1, N + 1)))
    model = solve_dtmc(spec, N, B)
    sim = simulate(spec, N, B, events=2000, warmup=200, replications=128, seed=idx)
    assert abs(sim.throughput / model.throughput - 1) < 0.015, (N, B, model.throughput, sim.throughput)
    assert sim.utilisation == pytest.approx(model.utilisation, rel=0.03, abs=0.005)
    # Contention costs throughput whenever the two models overlap (with B_1 = N they never do).
    free = dataclasses.replace(spec, contention=None)
    assert model.throughput <= solve_dtmc(free, N, B).throughput * (1 + 1e-12)
    assert solve_dtmc(spec, N, (1, 1)).throughput < solve_dtmc(free, N, (1, 1)).throughput


def test_contention_matches_simulator_three_models() -> None:
    # Three models: pairs are charged one after another, an approximation of the simulator's rates.
    spec = SystemSpec.build([[0.5, 0.3, 0.2]] * 3, [[1, 1, 1]] * 3, [3 * MS, 7 * MS, 11 * MS], delta=MS,
                           contention=_flat(3, 0.2))
    model = solve_dtmc(spec, 3, (1, 1, 2))
    sim = simulate(spec, 3, (1, 1, 2), events=2000, replications=128, seed=4)
    assert abs(sim.throughput / model.throughput - 1) < 0.03


def test_charges_are_exact_in_expectation_at_a_coarse_quantum() -> None:
    # 2 ms and 20 ms steps at a 1 ms quantum: every small step the large one overlaps charges it
    # 0.2 * 2 ms = 0.4 quanta. Rounded to the nearest quantum the charges vanished (the chain then
    # ignored contention: 7 % off); rounded at random they are exact in expectation. What is left
    # is the large model's own launch rounded to the nearest quantum, like its step latency,
    # and it shrinks with the quantum.
    con = Contention.build(2, [(1, 1, 0, 1, 0.2), (0, 1, 1, 1, 0.0)])
    sim = None
    errors = []
    for delta in (MS, 0.25 * MS):
        spec = SystemSpec.build(R2R_P, R2R_C, [2 * MS, 20 * MS], delta=delta, contention=con)
        model = solve_dtmc(spec, 4, (1, 1))
        sim = sim or simulate(spec, 4, (1, 1), events=3000, replications=128, seed=2)
        errors.append(abs(sim.throughput / model.throughput - 1))
        assert model.throughput < solve_dtmc(dataclasses.replace(spec, contention=None), 4, (1, 1)).throughput * 0.95
    assert errors[0] < 0.025 and errors[1] < 0.006


def test_contention_table_interpolates_between_measured_batches() -> None:
    con = Contention.build(2, [(1, 1, 0, 1, 0.2), (1, 9, 0, 1, 0.6), (1, 1, 0, 5, 0.4), (1, 9, 0, 5, 0.8)])
    K = con.table(12)
    assert K[1, 0, 1, 1] == pytest.approx(0.2) and K[1, 0, 9, 5] == pytest.approx(0.8)
    assert K[1, 0, 5, 1] == pytest.approx(0.4)  # halfway in b_i
    assert K[1, 0, 5, 3] == pytest.approx(0.5)  # halfway in both
    assert K[1, 0, 12, 12] == pytest.approx(0.8)  # constant beyond the grid
    assert not K[0].any() and not K[:, :, 0].any()  # unmeasured pair, and idle models


@pytest.mark.parametrize("points,msg", [
    ([(0, 1, 0, 1, 0.1)], "two different"),
    ([(0, 0, 1, 1, 0.1)], "batch sizes"),
    ([(0, 1, 1, 1, 1.2)], "kappa"),
    ([(0, 1, 1, 1, 0.1), (0, 4, 1, 4, 0.1)], "missing from the grid"),
    ([(0, 1, 1, 1, 0.1), (0, 1, 1, 1, 0.2)], "given twice"),
])
def test_contention_bad_input(points, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        Contention.build(2, points)
    with pytest.raises(ValueError, match="contention is for 3 models"):
        SystemSpec.build(R2R_P, R2R_C, R2R_L, contention=_flat(3, 0.1))


# --------------------------------------------------------------------------
# Step-sync and eager as candidates


@pytest.mark.parametrize("con", [None, Contention.build(2, [(1, 1, 0, 1, 0.5), (1, 8, 0, 1, 0.3),
                                                            (0, 1, 1, 1, 0.6), (0, 1, 1, 8, 0.4)])])
@pytest.mark.parametrize("N", [1, 3, 8])
def test_sync_and_eager_predictions_match_simulator(con, N) -> None:
    spec = SystemSpec.build([[0.6, 0.4], [0.7, 0.3]], [[1, 0], [1, 1]],
                           [LatencyModel(2 * MS, 0.1 * MS), LatencyModel(18 * MS, 2 * MS)], delta=0.1 * MS,
                           contention=con)
    sync = sync_throughput(spec, N)
    sim = simulate(spec, N, (1, 1), schedule="sync", events=2000, replications=128, seed=N)
    assert sync.throughput == pytest.approx(sim.throughput, rel=0.01)
    assert sync.utilisation == pytest.approx(sim.utilisation, rel=0.02, abs=0.005)
    eager = solve_dtmc(spec, N, (1, 1))
    sim_e = simulate(spec, N, (1, 1), events=2000, replications=128, seed=N)
    assert eager.throughput == pytest.approx(sim_e.throughput, rel=0.015)
    if N == 1:  # one request: every schedule runs the same steps
        assert sync.throughput == pytest.approx(eager.throughput, rel=1e-6)


def test_sync_closed_form_two_requests() -> None:
    # Two requests that always move together: each round both step on one model. No contention
    # (one model at a time), so T = 2 tokens per (L_0 + L_1) for the ping-pong.
    spec = SystemSpec.build([[0, 1], [1, 0]], [[0, 1], [1, 0]], [5 * MS, 15 * MS], delta=MS,
                           contention=_flat(2, 0.5))
    assert sync_throughput(spec, 2).throughput == pytest.approx(4 / 20e-3, rel=1e-9)


def test_choose_schedule_picks_the_best_candidate() -> None:
    spec = SystemSpec.build(R2R_P, R2R_C, R2R_L)
    row = best_thresholds(spec, 4, cache=SolveCache())
    s = choose_schedule(row, sync_throughput(spec, 4))
    assert s.mode == "delayed" and s.choice == ("delayed", (1, 3)) and s.predicted == row.best_throughput
    assert s.eager == pytest.approx(row.throughput_of((1, 1)))
    faster = choose_schedule(row, row.best_throughput * 1.1)
    assert faster.choice == ("sync",) and faster.predicted == pytest.approx(row.best_throughput * 1.1)
    assert choose_schedule(row, row.best_throughput * 1.1, sync_margin=0.2).mode == "delayed"
    # B* must beat the better of eager and sync by more than delayed_margin, or that one runs
    sync = sync_throughput(spec, 4)
    gain = row.best_throughput / max(s.eager, sync.throughput) - 1
    assert gain > 0
    assert choose_schedule(row, sync, delayed_margin=0.99 * gain).choice == ("delayed", (1, 3))
    simple = "sync" if sync.throughput > s.eager else "eager"
    held = choose_schedule(row, sync, delayed_margin=1.01 * gain)
    assert held.mode == simple and held.predicted == max(s.eager, sync.throughput)
    assert held.best_thresholds == (1, 3) and held.delayed == row.best_throughput  # B* is still reported
    with pytest.raises(ValueError, match="delayed_margin"):
        choose_schedule(row, sync, delayed_margin=-0.1)
    one = best_thresholds(spec, 1, cache=SolveCache())
    assert choose_schedule(one, 0.0).choice == ("eager",)  # B* = all ones is eager
    # One request: sync runs the same steps; it must not win on the solver's rounding.
    assert choose_schedule(one, sync_throughput(spec, 1)).choice == ("eager",)
    # ... nor on the two methods' difference (1.3e-6 relative on cpu-tiny's fitted profile)
    assert choose_schedule(one, one.best_throughput * (1 + 1.3e-6)).choice == ("eager",)
    assert choose_schedule(one, one.best_throughput * (1 + 1e-4)).choice == ("sync",)


def test_contention_moves_the_optimum_towards_sync_or_larger_batches() -> None:
    # A slow small model (a third of the large one's step) on shared hardware, mostly routed to
    # the large one: the chain without contention values overlaps that cost here.
    P, C = [[0.3, 0.7], [0.2, 0.8]], [[1, 0], [1, 1]]
    lat = [LatencyModel(6 * MS, 0.3 * MS), LatencyModel(18 * MS, 1.5 * MS)]
    con = Contention.build(2, [(1, 1, 0, 1, 0.5), (0, 1, 1, 1, 0.5)])
    free = SystemSpec.build(P, C, lat, delta=0.25 * MS)
    shared = SystemSpec.build(P, C, lat, delta=0.25 * MS, contention=con)
    N = 8
    row_free, row_shared = (best_thresholds(s, N, cache=SolveCache()) for s in (free, shared))
    # Every schedule loses throughput to contention, the overlapping ones most.
    assert row_shared.best_throughput < row_free.best_throughput
    loss_eager = row_shared.throughput_of((1, 1)) / row_free.throughput_of((1, 1))
    loss_best = row_shared.best_throughput / row_free.best_throughput
    assert loss_eager < loss_best


# --------------------------------------------------------------------------
# Drift: when to re-solve and when to swap


def test_routing_drift_needs_both_margin_and_significance() -> None:
    ref = [[0.65, 0.35], [1.0, 0.0]]
    rng = np.random.default_rng(0)
    for _ in range(20):  # 200 decisions drawn at the reference: noise only
        k = rng.binomial(200, 0.35)
        assert not routing_drift(ref, [[200 - k, k], [200, 0]], margin=0.05, z=3.0).drifted
    # 0.35 -> 0.42 on 60 decisions: past the margin but within noise (se ~0.06).
    assert not routing_drift(ref, [[35, 25], [60, 0]], margin=0.05, z=3.0).drifted
    # The same shift on 6000 decisions is drift, and the observed matrix is the counts'.
    d = routing_drift(ref, [[3480, 2520], [6000, 0]], margin=0.05, z=3.0)
    assert d.drifted and d.entry in ((0, 0), (0, 1)) and d.moved == pytest.approx(0.07)
    assert d.observed_P[0] == pytest.approx([0.58, 0.42])
    # A tiny move on a huge sample is significant but within the margin: no re-solve.
    assert not routing_drift(ref, [[640000, 360000], [1000, 0]], margin=0.05, z=3.0).drifted
    # Rows without enough decisions keep the reference.
    d = routing_drift(ref, [[3480, 2520], [10, 5]], margin=0.05, z=3.0, min_row=50)
    assert d.observed_P[1] == pytest.approx([1.0, 0.0])
    with pytest.raises(ValueError, match="shape"):
        routing_drift(ref, [[1, 2, 3]])


def _tuner(**kw) -> Tuner:
    cfg = TunerConfig.build(R2R_P, R2R_C, R2R_L, 4, delta=0.3e-3, **kw)
    return Tuner(cfg)


def test_tuner_proposes_nothing_without_drift() -> None:
    t = _tuner()
    assert t.propose(np.array([[650, 350], [350, 0]])) is None
    assert t.maybe_resolve() is False  # no decisions yet


def test_tuner_swaps_only_where_the_gain_exceeds_the_noise(caplog: pytest.LogCaptureFixture) -> None:
    t = _tuner(min_gain=0.03)
    before = {N: t.schedule(N) for N in range(1, 5)}
    # The small model now hands off 80 % of the time.
    counts = np.array([[2000, 8000], [8000, 0]], dtype=float)
    with caplog.at_level(logging.INFO, logger="aiorouter.tuning"):
        p = t.propose(counts)
    assert p is not None and p.drift.drifted and "re-solving" in caplog.text
    assert t.schedule(4) == before[4]  # nothing adopted yet
    new_spec = SystemSpec.build(p.solved.P, R2R_C, R2R_L, 0.3e-3)
    for N in range(1, 5):
        row = best_thresholds(new_spec, N, cache=SolveCache())
        old_b = before[N].thresholds
        gain = row.best_throughput / row.throughput_of(old_b) - 1
        assert p.gains[N] == pytest.approx(gain, rel=1e-6, abs=1e-9)
        if N in p.changed:
            assert gain > 0.03 and p.solved.schedules[N].thresholds == row.best
        else:  # kept: the old choice, priced under the new P
            assert p.solved.schedules[N].thresholds == old_b
            assert p.solved.schedules[N].predicted == pytest.approx(row.throughput_of(old_b), rel=1e-9)
    assert p.changed  # this drift moves some optimum by more than 3 %
    t.adopt(p)
    assert abs(t.solved_P[0, 1] - 0.8) < 1e-9
    assert all(t.thresholds(N) == p.solved.schedules[N].thresholds for N in range(1, 5))
    # With a noise floor above every gain, the same drift re-solves but swaps nothing.
    t2 = _tuner(min_gain=10.0)
    p2 = t2.propose(counts)
    assert p2 is not None and p2.changed == ()
    t2.adopt(p2)
    assert [t2.thresholds(N) for N in range(1, 5)] == [before[N].thresholds for N in range(1, 5)]
    assert abs(t2.solved_P[0, 1] - 0.8) < 1e-9  # later drift is measured from the new P


def test_tuner_rechecks_the_state_budget_on_resolve() -> None:
    t = _tuner(table_states=20_000)
    p = t.propose(np.array([[2000, 8000], [8000, 0]], dtype=float))
    assert p is not None
    # The quantum was re-chosen from the budget for the new P: the table fits it.
    states = sum(c.num_states for r in p.solved.table.rows for c in r.candidates)
    assert states <= 20_000 and p.solved.delta != t.delta


def test_tuner_schedules_carry_sync_and_eager() -> None:
    con = Contention.build(2, [(1, 1, 0, 1, 0.5), (0, 1, 1, 1, 0.5)])
    t = Tuner(TunerConfig.build(R2R_P, R2R_C, R2R_L, 4, delta=0.3e-3, contention=con))
    spec = SystemSpec.build(R2R_P, R2R_C, R2R_L, 0.3e-3, con)
    for N in range(1, 5):
        s = t.schedule(N)
        assert s.sync == pytest.approx(sync_throughput(spec, N).throughput, rel=1e-12)
        assert s.eager == pytest.approx(solve_dtmc(spec, N, (1, 1)).throughput, rel=1e-7)
        assert s.predicted == max(s.delayed, s.sync)
    assert t.schedule(40) == t.schedule(4)


def test_choose_delta_budgets_the_contention_chain() -> None:
    from aiorouter.tuning.dtmc import choose_delta
    from aiorouter.tuning.search import threshold_table
    lat = [LatencyModel(1.9e-3, 0.1e-3), LatencyModel(19.2e-3, 5.5e-3)]
    con = Contention.build(2, [(1, 1, 0, 1, 0.5), (0, 1, 1, 1, 0.6)])
    choice = choose_delta(R2R_P, lat, 6, table_states=50_000, contention=con)
    spec = SystemSpec.build(R2R_P, R2R_C, lat, choice.delta, con)
    table = threshold_table(spec, 6, cache=SolveCache())
    assert sum(c.num_states for r in table.rows for c in r.candidates) <= 50_000
    # The same budget spent on one row buys a finer quantum.
    row = choose_delta(R2R_P, lat, 6, table_states=50_000, contention=con, min_concurrency=6)
    assert row.delta < choice.delta
    with pytest.raises(ValueError, match="min_concurrency 7 > max_concurrency 6"):
        choose_delta(R2R_P, lat, 6, min_concurrency=7)
