"""Scheduling properties on SimEngine: no deadlock for any feasible threshold, and real asynchrony."""
from __future__ import annotations

import asyncio
import itertools
import time

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from aiorouter import Router, RouterConfig
from policies import Policy


class MatrixPolicy(Policy):
    """Routes after every step by a row of P (seeded); the mover's token is committed on every
    move, as in a mixture ensemble."""
    name = "matrix"

    commit_on_send = True

    def __init__(self, P, seed=0):
        self.P = np.asarray(P, dtype=float)
        self.rng = np.random.default_rng(seed)

    def bind(self, model_names):
        super().bind(model_names)
        self.by_dest = [self.P[i][[i] + self.peers(i)] for i in range(self.M)]  # row i in destination order

    def route(self, result):
        return self.rng.choice(self.M, size=len(result.reqs), p=self.by_dest[result.model]).tolist()


def sim_models(latencies_ms):
    return {f"m{i}": {"engine": "sim", "latency_ms": l} for i, l in enumerate(latencies_ms)}


async def closed_loop(router, n, total_requests, max_tokens):
    """n workers; each sends its next request as soon as the last one ends."""
    done, tokens = 0, 0

    async def worker():
        nonlocal done, tokens
        while done < total_requests:
            done += 1
            res = await router.generate("go", max_tokens=max_tokens, ignore_eos=True)
            tokens += len(res.token_ids)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(n)))
    return tokens / (time.perf_counter() - t0)


@st.composite
def scenario(draw):
    m = draw(st.integers(2, 3))
    n = draw(st.integers(1, 16))
    rows = []
    for _ in range(m):
        w = np.array([draw(st.integers(0, 4)) for _ in range(m)], dtype=float) + 1e-9
        rows.append(w / w.sum())
    feasible = [b for b in itertools.product(range(1, n + 1), repeat=m) if sum(x - 1 for x in b) < n]
    b = draw(st.sampled_from(feasible))
    return m, n, np.array(rows), b, draw(st.integers(0, 2**16))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_no_deadlock_for_any_feasible_threshold(case):
    m, n, P, B, seed = case
    names = [f"m{i}" for i in range(m)]

    async def main():
        async with Router(sim_models([0.2] * m), RouterConfig(policy=MatrixPolicy(P, seed), mode="delayed",
                          thresholds=dict(zip(names, B)), max_concurrency=16)) as r:
            await asyncio.wait_for(closed_loop(r, n, total_requests=2 * n, max_tokens=6), timeout=30)
            assert r.num_active == 0

    asyncio.run(main())


def test_eager_beats_sync_at_n4():
    """Paper setting: small 6.0 ms, large 27.9 ms, R2R-like random routing with p = 0.35."""
    async def measure(mode):
        async with Router({"small": {"engine": "sim", "latency_ms": 6.0},
                           "large": {"engine": "sim", "latency_ms": 27.9}},
                          RouterConfig(policy="random", policy_args={"p": 0.35, "seed": 1}, mode=mode)) as r:
            return await closed_loop(r, 4, total_requests=32, max_tokens=40)

    sync = asyncio.run(measure("sync"))
    eager = asyncio.run(measure("eager"))
    assert eager > 1.1 * sync, (eager, sync)


def test_runs_on_uvloop_and_from_asyncio_run():
    import uvloop

    import aiorouter

    async def main():
        loop_type = type(asyncio.get_running_loop()).__module__
        r = Router(sim_models([0.5, 0.5]), RouterConfig(policy="random", policy_args={"p": 0.5}))
        await r.start()  # the Jupyter form: no context manager, top-level await
        try:
            res = await r.generate("hi", max_tokens=5, ignore_eos=True)
        finally:
            await r.close()
        return loop_type, res

    loop_type, res = aiorouter.run(main())
    assert loop_type.startswith("uvloop") and len(res.token_ids) == 5
    assert asyncio.run(main())[1].token_ids == res.token_ids


def test_auto_thresholds_come_from_the_throughput_model():
    """thresholds="auto": the router profiles its models, solves the DTMC, and runs with B*."""
    from aiorouter.tuning import SystemSpec, best_thresholds

    async def main():
        async with Router({"small": {"engine": "sim", "latency_ms": 6.0}, "large": {"engine": "sim", "latency_ms": 27.9}},
                          RouterConfig(policy="random", policy_args={"p": 0.35}, tune_concurrency=6)) as r:
            assert r.thresholds(4) == {"small": 1, "large": 1}  # serving starts at once, eagerly
            await r.wait_tuned()
            tuner = r.tuning.tuner
            lat = tuner.config.latency
            spec = SystemSpec.build([[0.65, 0.35], [1, 0]], [[1, 0], [1, 0]], list(lat), tuner.config.delta)
            for n in (2, 4, 6):
                assert tuple(r.thresholds(n).values()) == best_thresholds(spec, n).best
            assert r.thresholds(4)["large"] >= 2  # the paper's finding: the large model waits for a batch
            assert r.thresholds(20) == r.thresholds(6)  # past the solved range: its last row
            await closed_loop(r, 4, total_requests=4, max_tokens=20)
            assert tuner.estimator.observations > 0  # routing decisions feed the online estimate of P

    asyncio.run(main())
