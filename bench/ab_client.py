"""The modes benchmark as it stood before the redesign (3b5d399's bench/modes.py: the cpu-tiny
pair, `random` p = 0.35, 64 tokens, N closed-loop clients), reduced to the API both sides of an
A/B share, and run by `bench.ab_modes` as a file against whichever checkout PYTHONPATH names.
Prints one JSON object {"mode@N": tok/s} on stdout; writes nothing.

`--control-at N`: also "delayed-noretune@N", delayed with the start-up schedule kept
(`Router(retune=False)` where the runtime has it; the runtime before the redesign re-solved on
routing drift only, which `random` never shows, so there it is plain delayed): the runtime's
own cost, apart from a re-solve's CPU while it runs.
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import random

from aiorouter import Router
from bench.common import closed_loop, tiny_qwen3


async def run_mode(mode: str, n: int, prompts, tokens: int, total: int, small, large) -> float:
    extra = {}
    if mode == "delayed-noretune":
        mode = "delayed"
        if "retune" in inspect.signature(Router).parameters:
            extra["retune"] = False
    async with Router({"small": str(small), "large": str(large)}, policy="random",
                      policy_args={"p": 0.35, "seed": 7}, entry="small", mode=mode, kv_memory_gb=1.0,
                      max_concurrency=max(16, n), **extra) as r:
        async def send(p):
            async for ev in r.stream(p, max_tokens=tokens, temperature=0.0, ignore_eos=True):
                yield ev.model

        await closed_loop(send, 1, prompts, 1)  # warm-up
        await r.wait_tuned()  # measure the tuned thresholds, not the B = 1 stand-in
        return (await closed_loop(send, n, prompts, total)).summary()["tok_s"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--modes", default="sync,eager,delayed")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=8, help="at least this many requests a run (as bench.modes)")
    ap.add_argument("--control-at", type=int, default=None, help="also run delayed-noretune at this N")
    args = ap.parse_args(argv)
    small, large = tiny_qwen3("small"), tiny_qwen3("large")
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 4096) for _ in range(rng.randrange(80, 120))] for _ in range(64)]
    out = {}
    for n in (int(x) for x in args.concurrency.split(",")):
        for mode in args.modes.split(",") + (["delayed-noretune"] if n == args.control_at else []):
            out[f"{mode}@{n}"] = asyncio.run(run_mode(mode, n, prompts, args.tokens,
                                                      max(n * args.requests_per_client, args.min_requests), small, large))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
