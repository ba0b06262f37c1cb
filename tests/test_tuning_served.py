"""Learning step costs and contention from served forwards (aiorouter/tuning/served.py), and the
tuner re-solving on them."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiorouter.tuning.inputs import Contention, LatencyModel, StepCost
from aiorouter.tuning.tuner import Tuner, TunerConfig
from aiorouter.tuning.learned import StepSpan, fit_served, overlap_shares


def _served(cost: list[StepCost], kappa: list[list[float]], scale: list[float], seconds: float,
            seed: int = 0, max_gap: float = 40e-3, burst: int = 6, heavy_gap: float = 0.0) -> list[list[StepSpan]]:
    """Two models stepping on one clock as the chain says they do: each step's work is
    scale * cost(b, T) seconds alone, done at rate 1 - kappa[i][j] while j is inside a step.
    Model 0 steps in bursts of `burst` steps with gaps up to `max_gap` between them (as a light
    model serves the requests handed to it, then waits); model 1 waits up to `heavy_gap` after
    each step (0: back to back). Each step's work varies by ~5 %. Integrated in 10 us ticks."""
    rng = np.random.default_rng(seed)
    dt = 1e-5
    spans: list[list[StepSpan]] = [[], []]
    left = [0.0, 0.0]  # work left in the current step (seconds alone)
    cur: list[tuple[float, int, int] | None] = [None, None]  # (start, batch, tokens)
    idle_until = [0.0, 0.0]
    done = [0, 0]
    t = 0.0
    while t < seconds:
        for i in (0, 1):
            if cur[i] is None and t >= idle_until[i]:
                b = int(rng.integers(1, 5))
                T = b * int(rng.integers(1, 4))
                # real steps vary by a few percent from one to the next
                cur[i], left[i] = (t, b, T), scale[i] * cost[i](b, T) * float(rng.lognormal(0.0, 0.05))
        busy = [c is not None for c in cur]
        for i in (0, 1):
            if busy[i]:
                left[i] -= dt * (1.0 - (kappa[i][1 - i] if busy[1 - i] else 0.0))
        t += dt
        for i in (0, 1):
            if busy[i] and left[i] <= 0:
                s, b, T = cur[i]
                spans[i].append(StepSpan(s, t, b, T))
                cur[i] = None
                done[i] += 1
                gap = (max_gap if done[i] % burst == 0 else 0.0) if i == 0 else heavy_gap
                idle_until[i] = t + float(rng.uniform(0, gap))
    return spans


COST = [StepCost(2e-3, 0.1e-3, 0.05e-3), StepCost(20e-3, 0.5e-3, 1e-3)]


def test_fit_recovers_the_scale_and_kappa_the_steps_were_served_with() -> None:
    kappa, scale = [[0.0, 0.35], [0.2, 0.0]], [1.0, 1.15]
    fit = fit_served(_served(COST, kappa, scale, seconds=6.0, heavy_gap=30e-3), COST)
    assert fit.steps[0] > 300 and fit.steps[1] > 100
    assert fit.kappa[0][1] == pytest.approx(0.35, abs=0.03)
    assert fit.kappa[1][0] == pytest.approx(0.2, abs=0.03)
    assert fit.scales[1] == pytest.approx(1.15, rel=0.03)
    assert fit.scales[0] == pytest.approx(1.0, rel=0.05)
    costs = fit.step_costs(COST)
    assert costs[1](2, 4) == pytest.approx(1.15 * COST[1](2, 4), rel=0.03)
    con = fit.contention()
    K = con.table(8)
    assert K[0, 1, 1, 1] == K[0, 1, 8, 8] == pytest.approx(fit.kappa[0][1])  # one kappa at every batch pair


def test_fit_bends_the_profile_where_the_batch_part_was_served_at_another_scale() -> None:
    """The heavy model's served steps cost 1.2x the profile's fixed part but 0.6x its batch part
    (as the smollm2 large model's did: batching cheaper than the profile's line): the fit finds
    both, and the step costs it hands the chain are the served ones at every batch."""
    served = [COST[0], StepCost(1.2 * COST[1].a, 0.6 * COST[1].per_seq, 0.6 * COST[1].per_token)]
    fit = fit_served(_served(served, [[0.0, 0.35], [0.2, 0.0]], [1.0, 1.0], seconds=6.0, heavy_gap=30e-3), COST)
    assert fit.scales[1] == pytest.approx(1.2, rel=0.05)
    assert fit.slopes[1] == pytest.approx(0.6, rel=0.1)
    costs = fit.step_costs(COST)
    for b, T in ((1, 1), (4, 12)):
        assert costs[1](b, T) == pytest.approx(served[1](b, T), rel=0.05)
    # (no single scale could: served / profiled is 1.16 at one sequence and token, 0.95 at 4 x 3)
    assert served[1](1, 1) / COST[1](1, 1) > 1.15 and served[1](4, 12) / COST[1](4, 12) < 0.96


def test_fit_where_the_overlap_barely_varies_takes_kappa_from_the_profile() -> None:
    """The light model steps with short gaps, so it always overlaps the heavy one: its scale and
    kappa cannot be told apart; kappa is the profile's and the scale takes the rest."""
    spans = _served(COST, [[0.0, 0.35], [0.2, 0.0]], [1.2, 1.0], seconds=2.0, max_gap=1e-3, burst=1)
    assert overlap_shares(spans[0], spans[1]).mean() > 0.95
    prior = Contention.build(2, [(0, 1, 1, 1, 0.3), (0, 1, 1, 4, 0.4), (1, 1, 0, 1, 0.2)])
    fit = fit_served(spans, COST, prior=prior)
    assert fit.kappa[0][1] == pytest.approx(0.35)  # the profile's mean
    assert fit.scales[0] == pytest.approx(1.2, rel=0.05)  # then the truth
    bare = fit_served(spans, COST)  # no profile: no contention, all of it in the scale
    assert bare.kappa[0][1] == 0.0 and bare.scales[0] > 1.2 / (1 - 0.35) * 0.95


def test_fit_without_contention_finds_none_and_keeps_too_few_steps_as_profiled() -> None:
    spans = _served(COST, [[0.0, 0.0], [0.0, 0.0]], [1.0, 1.0], seconds=2.0)
    fit = fit_served(spans, COST)
    assert max(fit.kappa[0][1], fit.kappa[1][0]) < 0.02
    assert fit.scales == pytest.approx((1.0, 1.0), rel=0.02)
    few = fit_served([spans[0][:10], spans[1]], COST)
    assert few.steps[0] == 0 and few.scales[0] == 1.0 and few.kappa[0] == (0.0, 0.0)
    with pytest.raises(ValueError, match="2 models' spans but 1 step costs"):
        fit_served(spans, COST[:1])


def test_fit_takes_decode_latency_models_too() -> None:
    lats = [LatencyModel(3e-3, 0.2e-3), LatencyModel(25e-3, 2e-3)]
    spans = _served([lambda b, T, m=m: m(b) for m in lats], [[0.0, 0.3], [0.1, 0.0]], [1.0, 1.0], seconds=5.0,
                    heavy_gap=30e-3)
    fit = fit_served(spans, lats)
    assert fit.kappa[0][1] == pytest.approx(0.3, abs=0.03)
    fitted = fit.latencies(lats)[1]  # served as profiled: both scales near 1, each on its own part
    assert (fitted.a, fitted.c) == (pytest.approx(lats[1].a * fit.scales[1]), pytest.approx(lats[1].c * fit.slopes[1]))
    for b in (1, 4):
        assert fitted(b) == pytest.approx(lats[1](b), rel=0.03)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0.01, 5)), min_size=1, max_size=12),
       st.lists(st.tuples(st.floats(0, 100), st.floats(0.01, 5)), max_size=12))
def test_overlap_shares_match_the_direct_sum(a, b) -> None:
    def disjoint(xs):  # one model's steps never overlap each other
        out, t = [], 0.0
        for gap, length in xs:
            out.append(StepSpan(t + gap, t + gap + length, 1, 1))
            t += gap + length
        return out

    mine, other = disjoint(a), disjoint(b)
    got = overlap_shares(mine, other)
    want = [sum(max(0.0, min(s.end, o.end) - max(s.start, o.start)) for o in other) / s.seconds for s in mine]
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_tuner_resolves_on_served_contention_and_step_costs() -> None:
    P, C = [[0.65, 0.35], [1.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]]
    lats = [LatencyModel(3e-3, 0.2e-3), LatencyModel(25e-3, 2e-3)]
    cfg = TunerConfig.build(P, C, lats, 4, delta=1e-3)
    tuner = Tuner(cfg)
    assert tuner.contention is None
    spans = _served([lambda b, T, m=m: m(b) for m in lats], [[0.0, 0.4], [0.3, 0.0]], [1.0, 1.2], seconds=5.0,
                    heavy_gap=30e-3)
    fit = fit_served(spans, lats)
    before = [r.best_throughput for r in tuner.table.rows]
    p = tuner.propose(np.zeros((2, 2)), served=fit)
    assert p is not None and p.cost_moved
    assert p.solved.contention is not None and p.solved.contention.table(4)[0, 1, 2, 2] == pytest.approx(fit.kappa[0][1])
    assert p.solved.latency[1](1) == pytest.approx(lats[1](1) * fit.scales[1])
    after = [r.best_throughput for r in p.solved.table.rows]
    assert all(a < b for a, b in zip(after, before))  # slower served steps: fewer tokens/s at every N
    tuner.adopt(p)
    assert tuner.contention is p.solved.contention
    assert tuner.propose(np.zeros((2, 2)), served=fit) is None  # solved with it now
    zero = fit_served([[], []], lats)  # too few steps: as profiled, no contention
    back = tuner.propose(np.zeros((2, 2)), served=zero)
    assert back is not None and back.solved.contention.is_zero
    assert back.solved.latency == tuple(lats)
    with pytest.raises(ValueError, match="contention_margin"):
        TunerConfig.build(P, C, lats, 4, contention_margin=-1)
