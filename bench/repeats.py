"""The target ratios, measured K times over: how far one sweep's single draw can be trusted.

    python -m bench.repeats --repeats 3 --requests-per-client 3

One full sweep measures each (system, N) once, and on these shared machines a ratio of two such
draws moves by several percent from run to run. Here only the runs the target ratios need
(cpu-tiny, low-effort) are made, every system once per round, rounds back to back, so each round
gives every ratio from runs minutes apart. Writes <out>/repeats.json and the table to --md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import workloads as W
from bench.baselines import HFNaive, make_rule
from bench.common import ROOT, machine
from bench.run import RATIO_PAIR, RATIOS, STD_PAGE_SIZE, Opts, _hf_threads, load_pair, run_one


def needed_runs() -> list[tuple[str, int, str]]:
    """(workload, N, system) of every run a target ratio reads, each once, grouped by (workload, N)."""
    runs: list[tuple[str, int, str]] = []
    for _, num, den, wl, n_num, n_den, _ in RATIOS:
        for key in ((wl, n_num, num), (wl, n_den, den)):
            if key not in runs:
                runs.append(key)
    return sorted(runs, key=lambda r: (r[0], r[1]))


def summarize(rounds: list[dict]) -> list[dict]:
    """Every target ratio in every round, then its median, spread and rounds meeting the target."""
    out = []
    for name, num, den, wl, n_num, n_den, target in RATIOS:
        vals = []
        for r in rounds:
            a, b = r.get(f"{wl}|{n_num}|{num}"), r.get(f"{wl}|{n_den}|{den}")
            if a and b:
                vals.append(a / b)
        out.append({"name": name, "target": target, "values": vals,
                    "median": statistics.median(vals) if vals else None,
                    "min": min(vals, default=None), "max": max(vals, default=None),
                    "rounds_met": sum(v >= target for v in vals), "rounds": len(vals)})
    return out


def table(summary: list[dict], data: dict) -> str:
    cfg = data["config"]
    lines = [f"{len(data['rounds'])} rounds, {cfg['requests_per_client']} requests per client, "
             f"commit {data['machine'].get('commit', '')[:7]}, {data['duration_s'] / 60:.0f} min in all.", "",
             "| ratio | target | median | min - max | rounds meeting it | per round |",
             "| --- | --- | --- | --- | --- | --- |"]
    for s in summary:
        if not s["values"]:
            lines.append(f"| {s['name']} | >= {s['target']:g}x | not measured | - | - | - |")
            continue
        lines.append(f"| {s['name']} | >= {s['target']:g}x | {s['median']:.2f}x | {s['min']:.2f} - {s['max']:.2f} | "
                     f"{s['rounds_met']} of {s['rounds']} | {', '.join(f'{v:.2f}' for v in s['values'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.repeats", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="rounds (each runs every needed system once)")
    ap.add_argument("--requests-per-client", type=int, default=3, help="closed-loop requests per client")
    ap.add_argument("--kv-memory-gb", type=float, default=4.0)
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--md", default=None, help="table file (default bench/RESULTS-repeats.md)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.requests_per_client < 1:
        ap.error("--repeats and --requests-per-client must be >= 1")
    out_dir = Path(args.out) if args.out else ROOT / "bench" / "results"
    md = Path(args.md) if args.md else ROOT / "bench" / "RESULTS-repeats.md"
    out_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    pair = load_pair(RATIO_PAIR)
    runs = needed_runs()
    hf, hf_threads = None, 0
    if any(s == "hf-naive" for _, _, s in runs):
        hf_threads, _ = _hf_threads(pair, "auto", quick=False)
        hf = HFNaive(pair.small, pair.large, make_rule(pair.policy, pair.policy_args), hf_threads)
    opts = Opts(args.kv_memory_gb, args.requests_per_client, 2, hf_threads, {"page_size": STD_PAGE_SIZE})
    wls = {w: W.make(w, vocab=pair.vocab) for w in {wl for wl, _, _ in runs}}
    path = out_dir / "repeats.json"
    data = {"machine": machine(), "config": {"pair": pair.name, "policy": pair.policy, "policy_args": pair.policy_args,
                                              "requests_per_client": args.requests_per_client,
                                              "kv_memory_gb": args.kv_memory_gb, "hf_threads": hf_threads,
                                              "runs_per_round": [list(r) for r in runs]},
            "rounds": [], "detail": []}
    from tqdm import tqdm
    with tqdm(total=args.repeats * len(runs), desc="repeats", unit="run") as bar:
        for k in range(args.repeats):
            tok_s, detail = {}, {}
            for wl, n, system in runs:
                bar.set_postfix_str(f"round {k + 1}: {wl} N={n} {system}")
                r = run_one(pair, system, wls[wl], n, opts, hf)
                key = f"{wl}|{n}|{system}"
                tok_s[key] = r.get("tok_s")
                detail[key] = {x: r.get(x) for x in ("tok_s", "error", "outside_cores", "seconds", "thresholds",
                                                      "mean_batch", "step_ms", "busy")}
                bar.update(1)
            data["rounds"].append(tok_s)
            data["detail"].append(detail)
            path.write_text(json.dumps({**data, "partial": True}, indent=1, default=str))  # crash-safe
    data["summary"] = summarize(data["rounds"])
    data["duration_s"] = time.perf_counter() - t0
    data["machine"]["load_avg_end"] = os.getloadavg()
    path.write_text(json.dumps(data, indent=1, default=str))
    md.write_text("# Target ratios, repeated\n\n" + table(data["summary"], data))
    print(table(data["summary"], data))
    print(f"wrote {path} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
