"""Ablation of the runtime's execution modes (`sync`, `eager`, `delayed`) on the cpu-tiny pair
with `random` routing (p = 0.35), at N = 1, 4, 8, 16 closed-loop clients.

    python bench/modes.py [--concurrency 1,4,8,16] [--tokens 64] [--requests-per-client 3]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm

from aiorouter import Router
from bench.common import closed_loop, tiny_qwen3, write_json


async def run_mode(mode: str, n: int, prompts, tokens: int, total: int, small: Path, large: Path) -> dict:
    async with Router({"small": str(small), "large": str(large)}, policy="random",
                      policy_args={"p": 0.35, "seed": 7}, entry="small", mode=mode, kv_memory_gb=1.0,
                      max_concurrency=max(16, n)) as r:
        async def send(p):
            async for ev in r.stream(p, max_tokens=tokens, temperature=0.0, ignore_eos=True):
                yield ev.model

        await closed_loop(send, 1, prompts, 1)  # warm-up
        # Measure the tuned thresholds: while the start-up solve runs, `delayed` serves with B = 1
        # and the solver shares the cores with the models.
        await r.wait_tuned()
        res = await closed_loop(send, n, prompts, total)
        out = res.summary()
        out["thresholds"] = r.thresholds(n)
        out["mean_batch"] = {k: m.mean_batch_size for k, m in r.metrics.models.items()}
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--modes", default="sync,eager,delayed")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=3)
    args = ap.parse_args(argv)
    small, large = tiny_qwen3("small"), tiny_qwen3("large")
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 4096) for _ in range(rng.randrange(80, 120))] for _ in range(64)]
    ns = [int(x) for x in args.concurrency.split(",")]
    modes = args.modes.split(",")
    rows = {}
    with tqdm(total=len(ns) * len(modes), desc="modes") as bar:
        for n in ns:
            for mode in modes:  # modes side by side at each N: drift hits them alike
                rows[f"{mode}@{n}"] = asyncio.run(run_mode(mode, n, prompts, args.tokens,
                                                           n * args.requests_per_client, small, large))
                bar.update(1)
    path = write_json("modes", {"policy": "random p=0.35", "tokens": args.tokens, "results": rows})
    print(f"| N | " + " | ".join(f"{m} tok/s" for m in modes) + " | eager/sync | delayed/eager |")
    print("|---|" + "---|" * (len(modes) + 2))
    for n in ns:
        t = {m: rows[f"{m}@{n}"]["tok_s"] for m in modes}
        print(f"| {n} | " + " | ".join(f"{t[m]:.1f}" for m in modes) +
              f" | {t.get('eager', 0) / max(t.get('sync', 1e-9), 1e-9):.2f} | {t.get('delayed', 0) / max(t.get('eager', 1e-9), 1e-9):.2f} |")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
