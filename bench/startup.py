"""What `thresholds="auto"` costs at start-up, on each real pair: the decode-step profile and the
contention measurement that `Router.start()` runs before it serves, the threshold solve that
then runs in the background, and when the first request is answered (before that solve ends,
every threshold 1 until it does). Each pair starts twice: with an empty contention cache
(measured) and again with the cache it left (read).

    python -m bench.startup [--pair cpu-tiny,smollm2] [--cap 16]

Writes bench/results/startup.json.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

from aiorouter import Router, RouterConfig
from bench import workloads as W
from bench.common import PAIRS, commas, load_pair, write_json


async def start_once(pair, cap: int) -> dict:
    """One router start with tuning on: -> the seconds of each part, from the constructor on."""
    models = {"small": str(pair.small), "large": str(pair.large)}
    prompt = W.short_prompts(seed=5, count=1, vocab=min(pair.vocab, W.VOCAB))[0]
    t0 = time.perf_counter()
    r = Router(models, RouterConfig(policy=pair.policy, policy_args=pair.policy_args, entry="small",
                                    tune_concurrency=cap, max_concurrency=cap, kv_memory_gb=1.0))
    try:
        await r.start()
        started = time.perf_counter() - t0
        res = await r.generate(prompt, max_tokens=16, ignore_eos=True)
        answered, tuned_at_answer = time.perf_counter() - t0, r.tuned
        await r.wait_tuned()
        tuned = time.perf_counter() - t0
        t = r.tuning
        return {"start_s": started, "first_answer_s": answered, "first_answer_tokens": len(res.token_ids),
                "tuned_at_first_answer": tuned_at_answer, "tuned_s": tuned,
                "profile_s": t.profile_seconds, "contention_s": t.contention_seconds, "solve_s": t.solve_seconds,
                "contention_measured": t.contention is not None, "schedule": t.describe()}
    finally:
        await r.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default=",".join(PAIRS))
    ap.add_argument("--cap", type=int, default=16, help="tune_concurrency: the largest N solved for")
    args = ap.parse_args(argv)
    names = commas(args.pair, allowed=PAIRS)
    if args.cap < 1:
        ap.error("--cap must be >= 1")
    out = {"cap": args.cap, "pairs": {}}
    for name in names:
        pair = load_pair(name)  # its models built or found in the real cache first
        runs = {}
        # the router keeps contention measurements under $AIOROUTER_CACHE/contention
        with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, {"AIOROUTER_CACHE": cache}):
            for key in ("contention_measured", "contention_cached"):
                runs[key] = asyncio.run(start_once(pair, args.cap))
                print(name, key, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in runs[key].items()})
            if not any(Path(cache, "contention").glob("*")):
                raise RuntimeError("the router wrote no contention cache: the second start measured again")
        out["pairs"][name] = runs
    path = write_json("startup", out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
