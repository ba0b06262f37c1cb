"""The paper's ablation on one GPU (its Figure 1a and Table 6): a routed Qwen3-0.6B / Qwen3-32B
pair (random weights, the real shapes), random routing p = 0.35, closed-loop clients.

The rungs, as the paper builds them up (section 5.3 and A.2):
  base      step-synchronous execution (both models step in lockstep), no CUDA graphs
  +graphs   the same with CUDA graphs ("engineering optimizations with extended CUDA graphs")
  +async    asynchronous execution: every model steps on its own (mode "eager")
  +delayed  asynchronous with delayed batching (mode "delayed", thresholds tuned at start-up)
Paper at concurrency 8 (Qwen3-0.6B + Qwen3-32B, 32B on TP 2): 132.78, 230.79, 296.86, 372.48
tokens/s. The pair's ratio (0.6B/32B, ~1:55 in weights) is kept: on one H200 the 32B model reads
65 GB per step (~15 ms at the copy bandwidth) and the 0.6B model is launch-bound, as on theirs.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

from bench.gpu.models import QWEN3_0_6B, QWEN3_32B, Run, free_cuda, model_dir, scaled

RUNGS = [("base", "sync", False), ("+graphs", "sync", True), ("+async", "eager", True), ("+delayed", "delayed", True)]
PAPER = {"base": 132.78, "+graphs": 230.79, "+async": 296.86, "+delayed": 372.48}


async def router_run(ctx, mode: str, graphs: bool, small, large, ns: list[int], tokens: int, per_client: int,
                     may_continue=lambda n: True) -> dict:
    """One Router over the pair; closed-loop at each N in `ns` (after a one-request warm-up and
    the start-up threshold solve), while `may_continue(n)` allows. -> {f"N={n}": summary}."""
    from aiorouter import ModelSpec, Router, RouterConfig
    from bench.common import closed_loop
    run = Run(ctx.device, ctx.dtype, ctx.attention, graphs)
    kv = max(ns) * (130 + tokens) * 2 + 1024
    specs = {name: ModelSpec(path=str(model_dir(ctx.root, shape)), device=str(ctx.device), dtype=str(ctx.dtype)[6:],
                             num_kv_tokens=kv, engine_config=run.engine_config(max_num_seqs=max(16, max(ns)),
                                                                               max_model_len=1024))
             for name, shape in (("small", small), ("large", large))}
    rng = random.Random(0)
    prompts = [[rng.randrange(2, small.vocab) for _ in range(rng.randrange(80, 120))] for _ in range(64)]
    out: dict = {}
    t0 = time.perf_counter()
    async with Router(specs, RouterConfig(policy="random", policy_args={"p": 0.35, "seed": 7}, entry="small", mode=mode,
                      device=str(ctx.device), max_concurrency=max(16, max(ns)), tune_concurrency=max(ns))) as r:
        out["start_s"] = time.perf_counter() - t0

        async def send(p):
            async for ev in r.stream(p, max_tokens=tokens, temperature=0.0, ignore_eos=True):
                yield ev.model
        t1 = time.perf_counter()
        await closed_loop(send, 1, prompts, 1)  # warm-up: first steps, lazy inits
        t2 = time.perf_counter()
        await r.wait_tuned()
        out["warmup_s"], out["tune_s"] = t2 - t1, time.perf_counter() - t2
        for n in ns:
            if not may_continue(n):
                out[f"N={n}"] = {"skipped": "section time box"}
                continue
            before = {k: Counter(m.batch_sizes) for k, m in r.metrics.models.items()}
            res = (await closed_loop(send, n, prompts, n * per_client)).summary()
            steps = {k: m.batch_sizes - before[k] for k, m in r.metrics.models.items()}
            res["mean_batch"] = {k: _mean_batch(c) for k, c in steps.items()}
            res["steps"] = {k: sum(c.values()) for k, c in steps.items()}
            out[f"N={n}"] = res
            out.setdefault("to_main_s", time.perf_counter() - t0)  # start-up and the first N: a rung's cost
            ctx.put("partial", {mode: out})
        t3 = time.perf_counter()
    out["close_s"], out["wall_s"] = time.perf_counter() - t3, time.perf_counter() - t0
    return out


def _mean_batch(sizes: Counter) -> float | None:
    """Mean batch size of the steps counted in `sizes` (batch size -> steps)."""
    steps = sum(sizes.values())
    return sum(b * c for b, c in sizes.items()) / steps if steps else None


def modes(ctx) -> None:
    """N = 8 for every rung first (the figure to compare), then N = 1, 4, 16 on each rung's
    router while the time box leaves room for the rungs still to come."""
    small, large = scaled(QWEN3_0_6B, ctx.dry), scaled(QWEN3_32B, ctx.dry)
    main, extra = (2, [1]) if ctx.dry else (8, [1, 4, 16])
    tokens, per_client = (8, 1) if ctx.dry else (64, 2)
    ctx.put("pair", {"small": small.describe(), "large": large.describe()})
    ctx.put("workload", {"policy": "random p=0.35", "tokens_per_request": tokens, "requests_per_client": per_client,
                         "prompt_tokens": "80-119 random ids"})
    rungs = ctx.body.setdefault("rungs", {})
    cost = None  # seconds the first rung took to start and run N = main: what a rung needs
    for i, (name, mode, graphs) in enumerate(RUNGS):
        if name == "+graphs" and not ctx.graphs:
            rungs[name] = {"skipped": "CUDA graphs are off (they capture with Triton, which failed)"}
            continue
        graphs = graphs and ctx.graphs  # the fallback: the later rungs without graphs
        if ctx.left() < 0.8 * (cost or 0):
            rungs[name] = {"skipped": "section time box"}
            continue
        t0, later = time.perf_counter(), len(RUNGS) - i - 1

        def room(n, t0=t0, later=later, cost=cost):
            """N = main always; another N while the rungs to come keep a rung's time each (the first
            rung's own time so far, its build and N = main, before any rung has finished)."""
            per_rung = cost or time.perf_counter() - t0
            return n == main or ctx.left() > later * per_rung + 0.25 * per_rung
        res = asyncio.run(router_run(ctx, mode, graphs, small, large, [main] + extra, tokens, per_client, room))
        cost = cost or res.get("to_main_s")
        res["mode"], res["graphs"] = mode, graphs
        res["memory_after_free"] = free_cuda()
        rungs[name] = res
        ctx.put("rungs", rungs)
    base = rungs.get("base", {}).get(f"N={main}", {}).get("tok_s")
    ctx.put("ratios_at_main_n", {name: (r.get(f"N={main}", {}).get("tok_s") or 0) / base
                                 for name, r in rungs.items() if base and "skipped" not in r})
    ctx.put("paper_ratios", {k: v / PAPER["base"] for k, v in PAPER.items()})
