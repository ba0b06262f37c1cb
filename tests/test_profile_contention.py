"""Start-up profiles of real engines: step cost by batch and tokens, and contention between two
models stepping at once (with the runtime's thread plan and CoreShare)."""
from __future__ import annotations

import pytest

import engines.profile as profile
from aiorouter.cpu_threads import CoreShare, plan_threads
from aiorouter.tuning.inputs import Contention, StepCost, fit_step_cost
from conftest import make_tiny_qwen3
from engines import Engine, EngineConfig
from engines.profile import contention_pairs, profile_contention, profile_step_latency
from engines.sim import SimEngine


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory):
    small = make_tiny_qwen3(tmp_path_factory.mktemp("small"), hidden=64, layers=2)
    large = make_tiny_qwen3(tmp_path_factory.mktemp("large"), hidden=128, layers=4, seed=1)
    return [Engine(p, config=EngineConfig(num_kv_tokens=4096)) for p in (small, large)]


def test_contention_profile_of_two_real_engines(two_engines, tmp_path, monkeypatch):
    engines = two_engines
    free = [e.kv_usage().pages_free for e in engines]
    threads = plan_threads([e.num_params for e in engines], cores=2)
    assert threads == [1, 2]
    share = CoreShare.plan(engines, threads)
    pairs = contention_pairs(2, 4, heavy=1)
    assert pairs == [(1, 1, 0, 1), (1, 1, 0, 2), (1, 4, 0, 1), (1, 4, 0, 2)]
    got = profile_contention(engines, pairs, threads=threads, wrap=share.step_fn, steps=2, cache_dir=tmp_path)
    # Each run measures both models: the heavy one slowed by the light one and the reverse.
    assert sorted((s.model, s.batch, s.other, s.other_batch) for s in got) == sorted(
        [(i, bi, j, bj) for (i, bi, j, bj) in pairs] + [(j, bj, i, bi) for (i, bi, j, bj) in pairs])
    for s in got:
        assert s.solo_s > 0 and s.overlapped_s > 0
        assert 0 < s.other_busy <= 1.0
        assert 0.0 <= s.kappa <= 0.95
    assert [e.kv_usage().pages_free for e in engines] == free  # private KV freed
    con = Contention.from_samples(2, got)
    K = con.table(4)
    assert K.shape == (2, 2, 5, 5) and 0 <= K.min() and K.max() <= 0.95
    # The cache answers a second call without stepping the engines.
    monkeypatch.setattr(profile, "_measure_pair", lambda *a, **k: pytest.fail("measured again"))
    again = profile_contention(engines, pairs, threads=threads, wrap=share.step_fn, steps=2, cache_dir=tmp_path)
    assert again == got


def test_sim_engines_measure_no_contention(two_engines):
    sims = [SimEngine(0.001), SimEngine(0.004)]
    pairs = contention_pairs(2, 4, heavy=1)
    assert profile_contention(sims, pairs, threads=[1, 1]) == []
    # A sim beside a real model does not contend either: it sleeps through its steps.
    assert profile_contention([sims[0], two_engines[1]], pairs, threads=[1, 1]) == []
    assert Contention.from_samples(2, []).is_zero


@pytest.mark.parametrize("pairs,threads,msg", [
    ([(0, 1, 0, 1)], [1, 1], "bad contention pair"),
    ([(0, 0, 1, 1)], [1, 1], "bad contention pair"),
    ([(0, 1, 1, 1)], [1], "one thread count"),
])
def test_contention_profile_bad_input(two_engines, pairs, threads, msg):
    with pytest.raises(ValueError, match=msg):
        profile_contention(two_engines, pairs, threads=threads)


def test_step_cost_profile_and_fit(two_engines):
    e = two_engines[0]
    shapes = [(1, 1), (4, 1), (1, 16), (4, 4)]
    got = profile_step_latency(e, shapes, steps=2)
    assert set(got) == set(shapes) and all(t > 0 for t in got.values())
    cost = fit_step_cost(list(got), list(got.values()))
    assert isinstance(cost, StepCost) and min(cost.a, cost.per_seq, cost.per_token) >= 0
    # Exact data is recovered exactly; shapes that cannot separate the terms are refused.
    truth = StepCost(2e-3, 0.1e-3, 0.05e-3)
    cost = fit_step_cost(shapes, [truth(b, b * t) for b, t in shapes])
    assert cost.a == pytest.approx(truth.a) and cost.per_seq == pytest.approx(truth.per_seq)
    assert cost.per_token == pytest.approx(truth.per_token)
    assert cost.latency(3.0)(4) == pytest.approx(truth(4, 12))
    with pytest.raises(ValueError, match="separate batch from tokens"):
        fit_step_cost([(1, 1), (4, 1)], [1e-3, 2e-3])
    with pytest.raises(ValueError, match=">= 1"):
        cost.latency(0.5)


def test_dispatched_latency_times_steps_through_the_worker(two_engines):
    """The router's start-up profile: steps handed to a one-thread worker from the event loop, on a
    sim (which sleeps L(b)) and on a real engine; every batch size answered, private KV freed."""
    import asyncio

    from engines.profile import profile_dispatched_latency
    from engines.worker import Worker

    sim = SimEngine(0.004, 0.001)
    real = two_engines[0]
    free = real.kv_usage().pages_free
    with Worker("profile") as pool:
        got = asyncio.run(profile_dispatched_latency(sim, pool, [1, 3], steps=2))
        assert sorted(got) == [1, 3] and got[1] >= 0.005 and got[3] >= 0.007  # never under the sim's L(b)
        got = asyncio.run(profile_dispatched_latency(real, pool, [1, 2], steps=2))
    assert sorted(got) == [1, 2] and all(t > 0 for t in got.values())
    assert real.kv_usage().pages_free == free
