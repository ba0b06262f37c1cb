"""What the protocol's fields cost (issue 40): the default pair's throughput with none of the new
request fields, against another checkout (one from before they existed), and with log probabilities
asked for (`logprobs=True, top_logprobs=5`, what a completions request's `logprobs=5` becomes).

    python -m bench.protocol_cost --against DIR [--rounds 8] [--n 8] [--tokens 64] [--out FILE]

N greedy requests of `--tokens` tokens each (ignore_eos) start together on `default_router` with
fixed thresholds and no re-solving (the tuner's child would add 10-15 % of noise on 2 cores); the
three sides run in fresh processes in turns, the order rotated and reversed each round, so drift on
a shared machine hits each alike; the figures to read are the ratios of the medians. As in
bench.host_cost, a child imports only the runtime's public API, so the same file measures DIR.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
PROMPTS = ["Explain why the sky is blue.", "Write a short poem about rivers.", "List three uses of copper.",
           "What is a prime number?", "Describe how a bicycle works.", "Why do cats purr?",
           "Summarize the water cycle.", "What causes tides?"]
SIDES = ("this, no new fields", "other, no new fields", "this, logprobs=5")


async def serve(logprobs: bool, n: int, tokens: int) -> float:
    """One run on the default pair -> output tokens per second of the timed part."""
    from aiorouter.defaults import default_router

    kw = {"logprobs": True, "top_logprobs": 5} if logprobs else {}
    async with default_router(mode="delayed", max_concurrency=n, thresholds={"small": 4, "large": 2},
                              retune=False) as r:
        await r.generate(PROMPTS[0], max_tokens=8, ignore_eos=True)  # warm-up
        t = time.perf_counter()
        got = await asyncio.gather(*(r.generate(PROMPTS[i % len(PROMPTS)], max_tokens=tokens, ignore_eos=True, **kw)
                                     for i in range(n)))
        wall = time.perf_counter() - t
    if logprobs and not all(g.logprobs is not None and len(g.logprobs) == tokens for g in got):
        raise SystemExit("a request asked for log probabilities and some tokens came back without")
    return sum(len(g.token_ids) for g in got) / wall


def measure(tree: Path, logprobs: bool, n: int, tokens: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(HERE), "--child", "--n", str(n), "--tokens", str(tokens)] + (["--logprobs"] if logprobs else [])
    done = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True, cwd=str(tree))
    return json.loads(done.stdout.strip().splitlines()[-1])["tok_s"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, help="a checkout from before the fields (a git worktree)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--logprobs", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=HERE.parent / "results" / "protocol_cost.json")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps({"tok_s": asyncio.run(serve(args.logprobs, args.n, args.tokens))}))
        return 0
    if args.against is None:
        ap.error("--against DIR is required: the figure is a ratio to another checkout")
    from bench.common import machine, rotated, write_atomic

    this = HERE.parents[1]
    plan = {SIDES[0]: (this, False), SIDES[1]: (args.against.resolve(), False), SIDES[2]: (this, True)}
    runs: dict[str, list[float]] = {s: [] for s in SIDES}
    for rnd in range(args.rounds):
        order = rotated(list(SIDES), rnd)
        for side in (order if rnd % 2 == 0 else order[::-1]):
            runs[side].append(round(measure(*plan[side], args.n, args.tokens), 2))
            print(f"round {rnd + 1}/{args.rounds} {side}: {runs[side][-1]} tok/s", flush=True)
    med = {s: statistics.median(v) for s, v in runs.items()}
    spread = {s: round(statistics.stdev(v) / statistics.mean(v), 3) for s, v in runs.items() if len(v) > 1}
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "against": str(args.against),
              "n": args.n, "tokens": args.tokens, "tok_s": runs, "median_tok_s": med, "cv": spread,
              "this_over_other": round(med[SIDES[0]] / med[SIDES[1]], 3),
              "logprobs5_over_none": round(med[SIDES[2]] / med[SIDES[0]], 3)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("median_tok_s", "cv", "this_over_other", "logprobs5_over_none")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
