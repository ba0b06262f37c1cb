"""The runtime's ceiling: host time per committed token, with models that cost nothing.

Two sim models of zero latency (a step returns at once), the `random` policy at p = 0.35, N
requests of `--tokens` tokens each started together; the wall time is then the runtime's own work
(routing, commit and stop checks, detokenizing, handoffs, the hop to each model's worker and
back), which on a GPU is what a step of a few milliseconds waits for (issue 45).

    python -m bench.host_cost [--n 16,64,256] [--modes eager,delayed,sync] [--tokens 1024]
                              [--rounds 3] [--profile] [--against DIR] [--out FILE]

`--profile` adds a pass under cProfile per (mode, N) and splits the event loop's time into the
parts above (shares of the profiled time, applied to the unprofiled µs per token). `--against
DIR` runs every measurement on this checkout and on DIR's runtime (a git worktree) in turns,
ABBA, so drift on a shared machine hits both alike; the figure to read is the ratio.

The script imports only `aiorouter`'s public API (Router, RouterConfig), so that the same file
measures another checkout: a child process runs it with PYTHONPATH set to that checkout.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
P = 0.35
PROMPT = list(range(1, 17))

# The parts of a token's host work, by where the profiled function lives: "file-part function" (the
# first match wins). "worker hop and loop" is the event loop itself: selecting on the workers'
# wake-ups (with zero-latency models, the wait for the worker thread to pick the step up and hand
# it back), running callbacks.
PARTS = [
    ("handoffs", ("routing.py _hand_off", "routing.py _check_send", "routing.py receive", "routing.py arrive",
                  "subserver.py handle", "subserver.py _take", "subserver.py drain", "aiorouter/launch.py",
                  "aiorouter/request.py Handoff", "engine.py resume", "engine.py add")),
    ("routing", ("policies/", "aiorouter/routing.py")),
    ("detokenizing", ("engines/detokenizer.py", "tokenizers", "output.py _take_text", "output.py text_of",
                      "request.py with_text", "router.py _with_text")),
    ("commit and stop checks", ("engines/output.py", "engine.py commit", "aiorouter/requests.py",
                                "subserver.py _publish", "engines/sequence.py")),
    ("scheduling", ("engines/scheduler.py", "engines/block_manager.py", "engines/prefix_cache.py",
                    "engine.py schedule", "engine.py waits", "engine.py finish")),
    ("the forward (sim)", ("engines/sim.py", "engines/runner.py", "torch/", "engine.py execute", "engine.py _timed")),
    ("worker hop and loop", ("asyncio/", "concurrent/futures", "threading.py", "queue.py", "selectors.py",
                             "engine.py _on", "engine.py _isolating")),
    ("router, metrics and streams", ("aiorouter/", "engines/")),
]


def router_config(mode: str, n: int):
    from aiorouter import RouterConfig

    # B = 1 for delayed: with zero-latency models the throughput model has nothing to weigh, and a
    # fixed schedule keeps the tuner's solve out of the measured run.
    return RouterConfig(policy="random", policy_args={"p": P, "seed": 7}, mode=mode, max_concurrency=max(n, 1),
                        thresholds={"small": 1, "large": 1}, kv_memory_gb=1.0, retune=False)


async def serve(mode: str, n: int, tokens: int, prof: cProfile.Profile | None = None) -> tuple[float, int]:
    """One run -> (wall seconds, tokens committed); `prof` profiles the timed part only."""
    from aiorouter import Router

    sim = {"engine": "sim", "latency_ms": 0.0}
    async with Router({"small": dict(sim), "large": dict(sim)}, router_config(mode, n)) as r:
        await r.generate(PROMPT, max_tokens=8, ignore_eos=True, temperature=0.0)  # warm-up

        async def one() -> int:
            res = await r.generate(PROMPT, max_tokens=tokens, ignore_eos=True, temperature=0.0)
            return len(res.token_ids)

        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        return wall, sum(got)


def breakdown(mode: str, n: int, tokens: int) -> dict[str, float]:
    """Shares of the event loop's profiled time per part (PARTS), from one run under cProfile. A
    built-in's own time (a torch op, a list append) counts where it was called from."""
    prof = cProfile.Profile()
    asyncio.run(serve(mode, n, tokens, prof))
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]

    def part(key: tuple) -> str:
        where = f"{key[0].replace(os.sep, '/')} {key[2]}"
        return next((name for name, keys in PARTS if any(k in where for k in keys)), "other")

    shares: dict[str, float] = {name: 0.0 for name, _ in PARTS}
    shares["other"] = 0.0
    for key, (_, _, tottime, _, callers) in stats.items():
        if key[0] == "~" and callers:  # a built-in: its time goes to its callers, as they called it
            for caller, (_, _, tt, _) in callers.items():
                shares[part(caller)] += tt
        else:
            shares[part(key)] += tottime
    total = sum(shares.values()) or 1.0
    return {k: v / total for k, v in shares.items()}


def child(args: argparse.Namespace) -> int:
    """One measurement in this process (the runtime on PYTHONPATH) -> one JSON line on stdout."""
    if args.child == "time":
        wall, toks = asyncio.run(serve(args.mode, args.n, args.tokens))
        print(json.dumps({"wall_s": wall, "tokens": toks}))
    else:
        print(json.dumps(breakdown(args.mode, args.n, args.tokens)))
    return 0


def measure(tree: Path | None, kind: str, mode: str, n: int, tokens: int) -> dict:
    """Run one measurement in a fresh process on `tree`'s runtime (None: this checkout)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree or HERE.parents[1])
    cmd = [sys.executable, str(HERE), "--child", kind, "--mode", mode, "--n", str(n), "--tokens", str(tokens)]
    done = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, text=True,
                          cwd=str(tree or HERE.parents[1]))
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="16,64,256")
    ap.add_argument("--modes", default="eager,delayed,sync")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--against", type=Path, default=None, help="another checkout, measured in turns with this one")
    ap.add_argument("--out", type=Path, default=HERE.parent / "results" / "host_cost.json")
    ap.add_argument("--child", choices=["time", "profile"], help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.n = int(args.n)
        return child(args)
    from bench.common import machine  # (the parent only: a child imports nothing but the runtime it measures)

    sides = {"this": None} if args.against is None else {"this": None, "other": args.against.resolve()}
    rows = []
    for n in (int(x) for x in args.n.split(",")):
        for mode in args.modes.split(","):
            runs: dict[str, list[float]] = {s: [] for s in sides}
            for rnd in range(args.rounds):
                for side in (list(sides) if rnd % 2 == 0 else list(reversed(sides))):
                    m = measure(sides[side], "time", mode, n, args.tokens)
                    runs[side].append(m["wall_s"] / m["tokens"] * 1e6)
            row = {"N": n, "mode": mode, "tokens": n * args.tokens,
                   **{f"{s}_us_per_token": [round(x, 2) for x in v] for s, v in runs.items()}}
            med = statistics.median(runs["this"])
            row["this_tok_s"] = round(1e6 / med)
            if "other" in runs:
                row["other_over_this"] = round(statistics.median(runs["other"]) / med, 3)
            if args.profile:
                row["parts_us_per_token"] = {k: round(v * med, 2)
                                             for k, v in measure(None, "profile", mode, n, args.tokens).items()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(),
                                    "date": time.strftime("%Y-%m-%d"), "policy": f"random p={P}",
                                    "against": None if args.against is None else str(args.against),
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
