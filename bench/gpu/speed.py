"""The GPU check's speed sections: two models' streams overlapping, decode tokens/s, and the
runtime's own host time per committed token."""
from __future__ import annotations

import asyncio
import json
import random
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from bench.gpu.models import HOST_LARGE, HOST_SMALL, QWEN3_1B, QWEN3_7B, Run, free_cuda, scaled
from engines import SamplingParams
from engines.profile import runner_info

COPY_BW = 4.3e12  # bytes/s, the H200's device-to-device copy measured here (KINDS.md): the step floor


def _start(eng, batch: int, prompt_len: int, max_tokens: int, vocab: int, seed: int) -> list:
    """`batch` requests, stepped until every prompt is prefilled and one decode ran (warm)."""
    rng = random.Random(seed)
    seqs = [eng.add_request([rng.randrange(2, vocab) for _ in range(prompt_len)],
                            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)) for _ in range(batch)]
    while min(s.num_output_tokens for s in seqs) < 2:
        eng.step()
    return seqs


def _steps(eng, k: int) -> float:
    t0 = time.perf_counter()
    for _ in range(k):
        eng.step()
    return time.perf_counter() - t0


def _drain(eng) -> None:
    while eng.has_unfinished():
        eng.step()


def decode(ctx) -> None:
    """Decode tokens/s of a ~1B and a ~7B random Qwen3 at several batch sizes, graphs on and off.
    The floor is the weights read once per step at the copy bandwidth (the small batches are
    memory-bound: every step reads every weight)."""
    batches, steps, prompt = ([1, 2], 3, 16) if ctx.dry else ([1, 8, 64, 256], 32, 128)
    for shape in (scaled(QWEN3_1B, ctx.dry), scaled(QWEN3_7B, ctx.dry)):
        floor_ms = 1e3 * shape.params * 2 / COPY_BW
        rows = ctx.body.setdefault("models", {}).setdefault(shape.name, {"model": shape.describe(), "floor_ms": floor_ms})
        for graphs in ((True, False) if ctx.graphs else (False,)):
            if ctx.left() < (5 if ctx.dry else 25):
                rows[f"graphs={graphs}"] = {"skipped": "section time box"}
                continue
            eng = Run(ctx.device, ctx.dtype, ctx.attention, graphs).engine(
                ctx.root, shape, ctx.streams, num_kv_tokens=max(batches) * (prompt + steps + 8) + 256,
                max_num_seqs=max(batches), max_num_batched_tokens=8192, max_model_len=1024, enable_prefix_caching=False)
            res = {}
            for b in batches:
                _start(eng, b, prompt, steps + 8, shape.vocab, seed=b)
                dt = _steps(eng, steps)
                res[f"batch={b}"] = {"tok_s": b * steps / dt, "step_ms": 1e3 * dt / steps}
                _drain(eng)
                rows[f"graphs={graphs}"] = {"results": res, "engine": runner_info(eng)}
                ctx.put("models", ctx.body["models"])
            del eng
            rows[f"graphs={graphs}"]["memory_after_free"] = free_cuda()
            ctx.put("models", ctx.body["models"])


def overlap(ctx) -> None:
    """Two models stepping in two threads, each on its own stream: their step loops alone and
    together (overlap = (alone_a + alone_b - together) / min(alone_a, alone_b): 1 when the shorter
    one hides inside the longer, 0 when they serialise), and, on CUDA, a profiler timeline of the
    together run: the time both streams have a kernel in flight over the shorter one's busy time."""
    # 150 steps: the 1B loop takes ~0.1 s and the 7B one ~0.5 s, far above thread start-up jitter
    k, batch, prompt = (4, 2, 16) if ctx.dry else (150, 8, 128)
    run = Run(ctx.device, ctx.dtype, ctx.attention, ctx.graphs)
    shapes = [scaled(QWEN3_1B, ctx.dry), scaled(QWEN3_7B, ctx.dry)]
    engines = [run.engine(ctx.root, s, ctx.streams, num_kv_tokens=batch * (prompt + 4 * k + 16) + 256, max_num_seqs=batch,
                          max_model_len=1024, enable_prefix_caching=False) for s in shapes]
    for i, e in enumerate(engines):
        _start(e, batch, prompt, 4 * k + 8, shapes[i].vocab, seed=i)
    ctx.put("models", [s.describe() for s in shapes])
    ctx.put("engines", [runner_info(e) for e in engines])
    alone = [_steps(e, k) for e in engines]
    together = _together(engines, k)
    wall = max(together)
    ctx.put("steps", {"k": k, "batch": batch, "alone_s": alone, "together_s": together,
                      "overlap": (sum(alone) - wall) / min(alone), "serial_s": sum(alone), "together_wall_s": wall})
    if ctx.device.type == "cuda":
        try:
            ctx.put("timeline", _timeline(engines, min(k, 30)))  # 30 steps: a trace of ~20k kernels
        except Exception as e:  # noqa: BLE001 (the step times above stand on their own)
            ctx.put("timeline", {"error": repr(e)})
    for e in engines:
        _drain(e)


def _together(engines, k: int) -> list[float]:
    out = [0.0] * len(engines)
    go = threading.Barrier(len(engines))

    def loop(i):
        go.wait()
        out[i] = _steps(engines[i], k)
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _timeline(engines, k: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _together(engines, k)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    spans = defaultdict(list)  # stream -> [(start us, end us)] of its kernels
    for e in events:
        if e.get("cat") == "kernel":
            spans[e.get("args", {}).get("stream")].append((e["ts"], e["ts"] + e.get("dur", 0)))
    busy = {s: _merge(v) for s, v in spans.items()}
    top = sorted(busy, key=lambda s: -_length(busy[s]))[:2]
    out = {"kernels_per_stream": {str(s): len(spans[s]) for s in spans},
           "busy_us": {str(s): _length(busy[s]) for s in top}}
    if len(top) == 2:
        both = _length(_intersect(busy[top[0]], busy[top[1]]))
        out.update(both_busy_us=both, concurrency=both / max(1e-9, min(_length(busy[s]) for s in top)))
    return out


def _merge(iv: list) -> list:
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(iv: list) -> float:
    return sum(b - a for a, b in iv)


def _intersect(x: list, y: list) -> list:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append([a, b])
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def host(ctx) -> None:
    """The runtime's own time per committed token, with models whose steps cost the GPU almost
    nothing (2 and 4 layers, hidden 256): each engine stepping alone at batch 1 and 16, then the
    Router (random p = 0.35, eager) around the two, closed-loop at N = 1 and 16. At N = 1 every
    step has batch 1, so overhead = router time per token - the steps it took x their time alone:
    what routing, subservers, queues and the event loop add per token."""
    from bench.gpu.modes import router_run
    small, large = scaled(HOST_SMALL, ctx.dry), scaled(HOST_LARGE, ctx.dry)
    k = 4 if ctx.dry else 200
    alone = {}
    for shape in (small, large):
        eng = Run(ctx.device, ctx.dtype, ctx.attention, ctx.graphs).engine(
            ctx.root, shape, ctx.streams, num_kv_tokens=16 * (64 + k + 16) + 256, max_num_seqs=16, max_model_len=1024)
        for b in (1, 16):
            _start(eng, b, 64, k + 8, shape.vocab, seed=b)
            dt = _steps(eng, k)
            alone[f"{shape.name}/batch={b}"] = {"step_ms": 1e3 * dt / k, "ms_per_token": 1e3 * dt / (b * k)}
            _drain(eng)
            ctx.put("engine_alone", alone)
        ctx.put(f"engine/{shape.name}", runner_info(eng))
        del eng
        free_cuda()
    ns, tokens = ([1, 2], 8) if ctx.dry else ([1, 16], 64)
    res = asyncio.run(router_run(ctx, "eager", ctx.graphs, small, large, ns, tokens, per_client=4 if not ctx.dry else 1))
    for n, r in res.items():
        if isinstance(r, dict) and r.get("tok_s"):
            r["ms_per_token"] = 1e3 / r["tok_s"]
    one = res.get("N=1", {})
    if one.get("tokens") and one.get("steps"):
        gpu_ms = sum(one["steps"][name] * alone[f"{shape.name}/batch=1"]["step_ms"]
                     for name, shape in (("small", small), ("large", large)))
        one["engine_ms_per_token"] = gpu_ms / one["tokens"]
        one["overhead_ms_per_token"] = one["ms_per_token"] - one["engine_ms_per_token"]
    ctx.put("router_eager", res)
    ctx.put("ceiling", ceiling((2,) if ctx.dry else (16, 64, 256), 16 if ctx.dry else 128))


def ceiling(ns: tuple[int, ...], tokens: int) -> dict:
    """bench.host_cost on this machine's host: the runtime alone (two zero-latency sims, eager),
    us per committed token at each N and where the event loop's time goes."""
    from bench.host_cost import breakdown, serve
    out = {}
    for n in ns:
        wall, toks = asyncio.run(serve("eager", n, tokens))
        us = 1e6 * wall / toks
        out[f"N={n}"] = {"us_per_token": us, "tok_s": toks / wall,
                         "parts_us_per_token": {k: v * us for k, v in breakdown("eager", n, tokens).items()}}
    return out
