"""The modes benchmark (bench/modes.py) on two checkouts, interleaved, to compare them on one machine.

    python -m bench.ab_modes --before DIR [--rounds 3] [--concurrency 1,4,8,16] [--tokens 64]
                             [--requests-per-client 2] [--min-requests 8] [--control-at N]
                             [--name redesign_modes]

Each round runs bench/ab_client.py (the modes benchmark as it stood before the redesign, reduced to
the public API both checkouts share) against the `--before` checkout's runtime and against this
one's, in alternating order (ABBA...), so drift on a shared machine hits both alike. Writes
bench/results/NAME.json: every run's tok/s and, per mode@N, the median ratio this/before.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import ROOT, write_json


def run_modes(tree: Path, args) -> dict[str, float]:
    """One run of bench/ab_client.py (this checkout's file) against `tree`'s runtime."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(ROOT / "bench" / "ab_client.py"), "--concurrency", args.concurrency,
           "--tokens", str(args.tokens), "--requests-per-client", str(args.requests_per_client),
           "--min-requests", str(args.min_requests)]
    if args.control_at is not None:
        cmd += ["--control-at", str(args.control_at)]
    done = subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, type=Path, help="the other checkout (e.g. a git worktree)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=8,
                    help="at least this many requests a run: at N = 1, 2 requests (~2.5 s) moved a system's own runs by up to 25%%")
    ap.add_argument("--control-at", type=int, default=None,
                    help="also run delayed with the start-up schedule kept at this N (bench/ab_client.py)")
    ap.add_argument("--after", type=Path, default=ROOT, help="the checkout measured against --before (default: this one)")
    ap.add_argument("--name", default="redesign_modes")
    args = ap.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for rnd in range(args.rounds):
        order = ("before", "after") if rnd % 2 == 0 else ("after", "before")
        for which in order:
            runs[which].append(run_modes(trees[which], args))
            print(f"round {rnd + 1}/{args.rounds} {which}: " +
                  ", ".join(f"{k} {v:.1f}" for k, v in runs[which][-1].items()), flush=True)
    keys = list(runs["after"][0])
    ratios = {k: statistics.median(a[k] / b[k] for a, b in zip(runs["after"], runs["before"])) for k in keys}
    path = write_json(args.name, {"before": str(trees["before"]), "after": str(trees["after"]), "rounds": args.rounds, "tokens": args.tokens,
                                  "requests_per_client": args.requests_per_client, "min_requests": args.min_requests, "control_at": args.control_at, "runs": runs,
                                  "median_ratio_after_over_before": ratios})
    print("| mode@N | before tok/s (median) | after tok/s (median) | after/before (median of rounds) |")
    print("|---|---|---|---|")
    for k in keys:
        b = statistics.median(r[k] for r in runs["before"])
        a = statistics.median(r[k] for r in runs["after"])
        print(f"| {k} | {b:.1f} | {a:.1f} | {ratios[k]:.3f} |")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
