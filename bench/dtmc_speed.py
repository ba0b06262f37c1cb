"""Speed of the exhaustive DTMC threshold search (aiorouter.tuning).

Two cases, both with the paper's quantum delta = 0.1 ms:

* M = 2, R2R: P = [[0.65, 0.35], [1, 0]], C = [[1, 0], [1, 0]],
  L = 6.0 / 27.9 ms, every feasible B for every N = 1..16 (target < 5 s);
* M = 3, ME-like: every row of P = [0.5, 0.3, 0.2], C all ones,
  L = 6 / 15 / 27.9 ms, every feasible B for every N = 1..8 (target < 30 s).

Each run starts with an empty cache.  Writes bench/results/dtmc_speed.json
and bench/RESULTS-dtmc-speed.md.  Usage:

    python bench/dtmc_speed.py [--workers 1 2] [--skip-m3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import scipy  # noqa: E402

from aiorouter.tuning import ModelSpec, SolveCache, threshold_table  # noqa: E402

CASES = {
    "m2_r2r": dict(
        P=[[0.65, 0.35], [1.0, 0.0]], C=[[1.0, 0.0], [1.0, 0.0]], L=[6.0e-3, 27.9e-3],
        max_n=16, target_s=5.0,
    ),
    "m3_me": dict(
        P=[[0.5, 0.3, 0.2]] * 3, C=[[1.0] * 3] * 3, L=[6.0e-3, 15.0e-3, 27.9e-3],
        max_n=8, target_s=30.0,
    ),
}
DELTA = 1e-4


def cpu_seconds() -> float:
    """CPU time of this process and its (finished) worker processes."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_case(name: str, workers: int) -> dict:
    case = CASES[name]
    spec = ModelSpec.build(case["P"], case["C"], case["L"], DELTA)
    load_before = os.getloadavg()
    c0, t0 = cpu_seconds(), time.perf_counter()
    table = threshold_table(spec, case["max_n"], cache=SolveCache(), workers=workers)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds() - c0
    rows = []
    for r in table.rows:
        biggest = max(r.candidates, key=lambda c: c.num_states)
        rows.append(dict(
            N=r.N,
            candidates=len(r.candidates),
            states=sum(c.num_states for c in r.candidates),
            transitions=sum(c.num_transitions for c in r.candidates),
            largest_chain_states=biggest.num_states,
            largest_chain_B=list(biggest.B),
            best_B=list(r.best),
            best_tokens_per_s=round(r.best_throughput, 4),
            seconds=round(r.seconds, 4),
        ))
    return dict(
        case=name, workers=workers, delta_s=DELTA, P=case["P"], C=case["C"], L_s=case["L"],
        max_n=case["max_n"], target_s=case["target_s"],
        wall_s=round(wall, 3), cpu_s=round(cpu, 3),
        meets_target_wall=wall < case["target_s"],
        loadavg_before=[round(x, 2) for x in load_before],
        loadavg_after=[round(x, 2) for x in os.getloadavg()],
        total_states=sum(r["states"] for r in rows),
        total_transitions=sum(r["transitions"] for r in rows),
        total_candidates=sum(r["candidates"] for r in rows),
        rows=rows,
    )


def _burn(n: int) -> int:
    s = 0
    for i in range(n):
        s += i * i
    return s


def parallel_probe(n: int = 10_000_000) -> float:
    """Speed-up of 2 processes over 1 on a pure-Python loop, right now.

    ~2 on an idle 2-core machine; ~1 when other jobs already take a core,
    in which case no workers setting can show a parallel gain.
    """
    import multiprocessing as mp

    t = time.perf_counter()
    _burn(n)
    one = time.perf_counter() - t
    with mp.get_context("fork").Pool(2) as pool:
        t = time.perf_counter()
        pool.map(_burn, [n, n])
        two = time.perf_counter() - t
    return round(2 * one / two, 2)


def machine() -> dict:
    return dict(
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        python=platform.python_version(),
        numpy=np.__version__,
        scipy=scipy.__version__,
        cpu_count=os.cpu_count(),
        note="shared machine: other jobs were running; see loadavg per run. "
        "cpu_s (self + worker processes) is the load-independent figure.",
    )


def print_run(run: dict) -> None:
    print(f"\n== {run['case']}  workers={run['workers']}  wall {run['wall_s']:.2f}s  "
          f"cpu {run['cpu_s']:.2f}s  (target {run['target_s']:.0f}s wall)  "
          f"load {run['loadavg_before'][0]:.2f}->{run['loadavg_after'][0]:.2f}")
    print(f"{'N':>3} {'#B':>4} {'states':>11} {'transitions':>12} {'largest chain':>22} "
          f"{'B*':>10} {'tokens/s':>9} {'s':>7}")
    for r in run["rows"]:
        big = f"{r['largest_chain_states']:,} {tuple(r['largest_chain_B'])}"
        print(f"{r['N']:>3} {r['candidates']:>4} {r['states']:>11,} {r['transitions']:>12,} "
              f"{big:>22} {str(tuple(r['best_B'])):>10} {r['best_tokens_per_s']:>9.1f} "
              f"{r['seconds']:>7.2f}")
    print(f"total: {run['total_candidates']} chains, {run['total_states']:,} states, "
          f"{run['total_transitions']:,} transitions")


def markdown(result: dict) -> str:
    out = ["## DTMC threshold search speed (`bench/dtmc_speed.py`)", ""]
    m = result["machine"]
    out.append(f"Machine: {m['platform']}, {m['cpu_count']} CPUs, Python {m['python']}, "
               f"numpy {m['numpy']}, scipy {m['scipy']}.  The machine was shared with other "
               "jobs while measuring (load averages below), so wall time is inflated; "
               "CPU time (this process plus its workers) is the steadier figure.  A "
               "2-process probe (pure-Python loop) ran "
               f"{m.get('parallel_speedup_probe', float('nan'))}x faster than 1 process "
               "at the start (2.0 would mean two free cores).")
    out.append("")
    out.append("Exhaustive search: every feasible B (sum(B_i - 1) < N) for every N, "
               "delta = 0.1 ms, exact chain (no truncation), empty cache per run.")
    out.append("")
    out.append("| case | N | chains | states | transitions | workers | wall s | CPU s | "
               "load (1 min) | target | met? |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["runs"]:
        out.append(
            f"| {r['case']} | 1-{r['max_n']} | {r['total_candidates']} | {r['total_states']:,} | "
            f"{r['total_transitions']:,} | {r['workers']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
            f"{r['loadavg_before'][0]:.1f} | < {r['target_s']:.0f} s | "
            f"{'yes' if r['meets_target_wall'] else 'no'} |")
    for r in result["runs"]:
        if r["workers"] != 1:
            continue
        out += ["", f"States per N, {r['case']} (serial run):", "",
                "| N | chains | states | largest chain (B) | B* | predicted tokens/s | s |",
                "|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            out.append(
                f"| {row['N']} | {row['candidates']} | {row['states']:,} | "
                f"{row['largest_chain_states']:,} {tuple(row['largest_chain_B'])} | "
                f"{tuple(row['best_B'])} | {row['best_tokens_per_s']:.1f} | {row['seconds']:.2f} |")
    out += ["", "### Against the targets", ""]
    for r in result["runs"]:
        verdict = "meets" if r["meets_target_wall"] else "MISSES"
        line = (f"- {r['case']}, {r['workers']} worker(s): {r['wall_s']:.1f} s wall, "
                f"{r['cpu_s']:.1f} CPU-s vs the {r['target_s']:.0f} s target: {verdict} it "
                f"as measured (load {r['loadavg_before'][0]:.1f} on {m['cpu_count']} CPUs).")
        if r["workers"] > 1 and not r["meets_target_wall"]:
            line += (f" On an otherwise idle machine the {r['workers']} workers would need "
                     f"about {r['cpu_s'] / r['workers']:.0f} s plus load imbalance "
                     "(an estimate from CPU time, not a measurement).")
        out.append(line)
    out += ["", "### Where the time goes and what made it fast", "",
            "- States are packed into int64 keys and deduplicated in a vectorised "
            "open-addressing hash map; each BFS level is expanded at once with "
            "precomputed (convolved) multinomial outcome tables.",
            "- Chains of many small B share one BFS and one block-diagonal solve "
            "(per-level numpy overhead dominated M = 2).",
            "- The solver uses the chain's time structure: states where the slowest "
            "running model has just launched (5-15 %) meet every cycle, the rest is a "
            "DAG, so the censored chain is applied with one sparse triangular solve "
            "and solved by restarted GMRES in 15-70 applications; no LU fill-in "
            "(SuperLU needed over a minute for a single 9e4-state chain).",
            "- Roughly half the M = 3 time is the BFS (~0.1 us per transition) and half "
            "the solve; both are memory-bound numpy/scipy passes, so the remaining "
            "lever is more cores.",
            ""]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--skip-m3", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "dtmc_speed.json"))
    ap.add_argument("--markdown", default=str(ROOT / "bench" / "RESULTS-dtmc-speed.md"))
    ap.add_argument("--markdown-only", action="store_true",
                    help="rewrite the markdown from an existing --out JSON, run nothing")
    args = ap.parse_args()
    if args.markdown_only:
        Path(args.markdown).write_text(markdown(json.loads(Path(args.out).read_text())))
        print(f"wrote {args.markdown}")
        return 0
    probe = parallel_probe()
    print(f"2-process speed-up probe: {probe}x (2.0 = two free cores)")
    runs = [run_case("m2_r2r", 1)]
    print_run(runs[-1])
    if not args.skip_m3:
        for w in args.workers:
            runs.append(run_case("m3_me", w))
            print_run(runs[-1])
    result = dict(machine={**machine(), "parallel_speedup_probe": probe}, runs=runs,
                  generated=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    if args.markdown:
        Path(args.markdown).write_text(markdown(result))
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
