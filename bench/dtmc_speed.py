"""Speed of the exhaustive DTMC threshold search (aiorouter.tuning).

Two cases, both with the paper's quantum delta = 0.1 ms:

* M = 2, R2R: P = [[0.65, 0.35], [1, 0]], C = [[1, 0], [1, 0]],
  L = 6.0 / 27.9 ms, every feasible B for every N = 1..16 (target < 5 s);
* M = 3, ME-like: every row of P = [0.5, 0.3, 0.2], C all ones,
  L = 6 / 15 / 27.9 ms, every feasible B for every N = 1..8 (target < 30 s).

and the router's start-up solve (delta from the state budget, then the table
N = 1..cap on one core) for the bench pair (2.0 / 24.7 ms at batch 1 with
slopes 0.1 / 5.5 ms per request, cap 16), the paper pair (6.0 / 27.9 ms, cap
16) and the 3-model ME case (cap 8).

Each run starts with an empty cache.  Writes bench/results/dtmc_speed.json
and bench/results/dtmc_speed.md.  Usage (2 cores shared: take the lock):

    flock /tmp/aiorouter-cpu.lock python bench/dtmc_speed.py [--workers 1 2] [--skip-m3]
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

import aiorouter.tuning.solve as _solver  # noqa: E402
import aiorouter.tuning.dtmc as _dtmc  # noqa: E402
from aiorouter.tuning import (  # noqa: E402
    Contention, LatencyModel, SolveCache, SystemSpec, choose_delta, threshold_table,
)

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
STARTUP = {
    "bench_pair": dict(P=CASES["m2_r2r"]["P"], C=CASES["m2_r2r"]["C"], cap=16, target_s=15.0,
                       L=[LatencyModel(1.9e-3, 0.1e-3), LatencyModel(19.2e-3, 5.5e-3)]),
    "paper_pair": dict(P=CASES["m2_r2r"]["P"], C=CASES["m2_r2r"]["C"], cap=16, target_s=15.0,
                       L=[LatencyModel(6.0e-3), LatencyModel(27.9e-3)]),
    "me3": dict(P=CASES["m3_me"]["P"], C=CASES["m3_me"]["C"], cap=8, target_s=30.0,
                L=[LatencyModel(x) for x in CASES["m3_me"]["L"]]),
    # The bench pair with the contention profiled on the 2-core machine (large loses ~half its
    # progress while a small step runs, the small ~60 %): the chain of docs/throughput-model.md.
    "bench_pair_contention": dict(
        P=CASES["m2_r2r"]["P"], C=CASES["m2_r2r"]["C"], cap=16, target_s=15.0,
        L=[LatencyModel(1.9e-3, 0.1e-3), LatencyModel(19.2e-3, 5.5e-3)],
        contention=Contention.build(2, [(1, b1, 0, b0, k) for b1, b0, k in
                                        ((1, 1, 0.5), (1, 8, 0.45), (16, 1, 0.5), (16, 8, 0.45))] +
                                       [(0, b0, 1, b1, k) for b0, b1, k in
                                        ((1, 1, 0.65), (8, 1, 0.55), (1, 16, 0.65), (8, 16, 0.55))])),
}
# (module, function, phase) timed in serial runs; the solver's inner parts nest
# inside "stationary solve".
PHASES = [(_dtmc, "enumerate_chains", "BFS"), (_dtmc, "stationary_batch", "stationary solve"),
          (_solver, "solver_order", "  solver order"), (_solver, "solver_blocks", "  matrices"),
          (_solver, "gmres", "  GMRES"), (_dtmc, "_summarise", "summaries")]


def cpu_seconds() -> float:
    """CPU time of this process and its (finished) worker processes."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class PhaseTimer:
    """Wall seconds per phase (serial runs only: workers run in other processes)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._saved: list = []

    def __enter__(self) -> "PhaseTimer":
        for mod, fn, label in PHASES:
            real = getattr(mod, fn)
            self._saved.append((mod, fn, real))

            def timed(*a, _real=real, _label=label, **k):
                t = time.perf_counter()
                try:
                    return _real(*a, **k)
                finally:
                    self.seconds[_label] = self.seconds.get(_label, 0.0) + time.perf_counter() - t

            setattr(mod, fn, timed)
        return self

    def __exit__(self, *exc) -> None:
        for mod, fn, real in self._saved:
            setattr(mod, fn, real)


def run_case(name: str, workers: int) -> dict:
    case = CASES[name]
    spec = SystemSpec.build(case["P"], case["C"], case["L"], DELTA)
    load_before = os.getloadavg()
    with PhaseTimer() as phases:
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
        phases_s={k: round(v, 2) for k, v in phases.seconds.items()} if workers == 1 else {},
        rows=rows,
    )


BASELINE_CODE = """
import json, resource, sys, time
import aiorouter.tuning as tuning
from aiorouter.tuning import SolveCache, threshold_table
c = json.loads(sys.argv[1])
Spec = getattr(tuning, 'SystemSpec', None) or tuning.ModelSpec  # (older checkouts)
spec = Spec.build(c["P"], c["C"], c["L"], c["delta"])
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
threshold_table(spec, c["max_n"], cache=SolveCache(), workers=1)
r1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
print(json.dumps(dict(wall_s=time.perf_counter() - t0, cpu_s=cpu)))
"""


def run_baseline(src: str, name: str) -> dict:
    """The same serial search with another checkout's aiorouter (e.g. `git archive REV aiorouter`)."""
    import subprocess

    case = dict(CASES[name], delta=DELTA)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(ROOT)]))
    load_before = os.getloadavg()
    out = subprocess.run([sys.executable, "-c", BASELINE_CODE, json.dumps(case)], env=env,
                         capture_output=True, text=True, check=True, cwd=src).stdout
    got = json.loads(out.strip().splitlines()[-1])
    return dict(case=name, src=src, wall_s=round(got["wall_s"], 3), cpu_s=round(got["cpu_s"], 3),
                loadavg_before=[round(x, 2) for x in load_before],
                loadavg_after=[round(x, 2) for x in os.getloadavg()])


def run_startup(name: str) -> dict:
    """The router's start-up solve: choose_delta, then the table on one core."""
    case = STARTUP[name]
    load_before = os.getloadavg()
    c0, t0 = cpu_seconds(), time.perf_counter()
    con = case.get("contention")
    choice = choose_delta(case["P"], case["L"], case["cap"], contention=con)
    t_choose = time.perf_counter() - t0
    spec = SystemSpec.build(case["P"], case["C"], case["L"], choice.delta, con)
    table = threshold_table(spec, case["cap"], cache=SolveCache(), workers=1)
    wall = time.perf_counter() - t0
    return dict(
        case=name, cap=case["cap"], target_s=case["target_s"],
        latency_ms=[[round(1e3 * m.a, 4), round(1e3 * m.c, 4)] for m in case["L"]],
        delta_ms=round(1e3 * choice.delta, 5), max_rounding_error=round(choice.max_error, 5),
        mean_rounding_error=round(choice.mean_error, 5), budget_states=choice.budget,
        estimated_states=choice.table_states, largest_chain_states=choice.largest_chain,
        actual_states=sum(c.num_states for r in table.rows for c in r.candidates),
        choose_s=round(t_choose, 3), wall_s=round(wall, 3), cpu_s=round(cpu_seconds() - c0, 3),
        loadavg_before=[round(x, 2) for x in load_before],
        loadavg_after=[round(x, 2) for x in os.getloadavg()],
        best_at_cap=list(table.rows[-1].best),
        best_tokens_per_s=round(table.rows[-1].best_throughput, 3),
        meets_target_wall=wall < case["target_s"],
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
    import subprocess

    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, text=True,
                                capture_output=True, timeout=10).stdout.strip() or "?"
    except OSError:
        commit = "?"
    return dict(
        commit=commit,
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


def _load(r: dict) -> str:
    return f"{r['loadavg_before'][0]:.2f} -> {r['loadavg_after'][0]:.2f}"


def markdown(result: dict) -> str:
    m = result["machine"]
    out = ["## DTMC threshold search speed (`bench/dtmc_speed.py`)", "",
           f"Machine: {m['platform']}, {m['cpu_count']} CPUs, Python {m['python']}, numpy "
           f"{m['numpy']}, scipy {m['scipy']}; commit {m.get('commit', '?')}.  Shared with another "
           "engineer's jobs, so every run gives the 1-minute load average before -> after; CPU "
           "seconds (this process plus its workers) are the steadier figure.  A 2-process probe "
           f"(pure-Python loop) ran {m.get('parallel_speedup_probe', float('nan'))}x faster than 1 "
           "process at the start (2.0 = two free cores).  Runs were serialised with the other "
           "benchmarks by `flock /tmp/aiorouter-cpu.lock`.", "",
           "### Exhaustive search at delta = 0.1 ms", "",
           "Every feasible B (sum(B_i - 1) < N) for every N, exact chain (no truncation), empty "
           "cache per run.", "",
           "| case | N | chains | states | transitions | workers | wall s | CPU s | load | target "
           "| met? |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        out.append(
            f"| {r['case']} | 1-{r['max_n']} | {r['total_candidates']} | {r['total_states']:,} | "
            f"{r['total_transitions']:,} | {r['workers']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
            f"{_load(r)} | < {r['target_s']:.0f} s | {'yes' if r['meets_target_wall'] else 'no'} |")
    serial = [r for r in result["runs"] if r["workers"] == 1 and r.get("phases_s")]
    if serial:
        out += ["", "Where the serial time goes (wall s; the indented parts are inside the solve):", "",
                "| phase | " + " | ".join(r["case"] for r in serial) + " |",
                "|---|" + "---|" * len(serial)]
        for _, _, label in PHASES:
            vals = [f"{r['phases_s'].get(label, 0.0):.2f}" for r in serial]
            out.append(f"| {label.strip() if not label.startswith(' ') else '&nbsp;&nbsp;' + label.strip()} "
                       f"| " + " | ".join(vals) + " |")
    for r in serial:
        out += ["", f"States per N, {r['case']} (serial run):", "",
                "| N | chains | states | largest chain (B) | B* | predicted tokens/s | s |",
                "|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            out.append(
                f"| {row['N']} | {row['candidates']} | {row['states']:,} | "
                f"{row['largest_chain_states']:,} {tuple(row['largest_chain_B'])} | "
                f"{tuple(row['best_B'])} | {row['best_tokens_per_s']:.1f} | {row['seconds']:.2f} |")
    if result.get("startup"):
        out += ["", "### Router start-up solve (delta from the state budget, 1 core)", "",
                "`dtmc.choose_delta` then the table N = 1..cap, as `Router(thresholds=\"auto\")` "
                "runs it in the background.  Latency L(b) = a + c*b.", "",
                "| case | a, c per model (ms) | cap | delta ms | rounding max / mean | states est. / "
                "actual | choose s | wall s | CPU s | load | B* at cap | target | met? |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["startup"]:
            lat = "; ".join(f"{a:g}+{c:g}b" if c else f"{a:g}" for a, c in r["latency_ms"])
            out.append(
                f"| {r['case']} | {lat} | {r['cap']} | {r['delta_ms']:.4g} | "
                f"{100 * r['max_rounding_error']:.2f} % / {100 * r['mean_rounding_error']:.2f} % | "
                f"{r['estimated_states']:,} / {r['actual_states']:,} | {r['choose_s']:.2f} | "
                f"{r['wall_s']:.1f} | {r['cpu_s']:.1f} | {_load(r)} | {tuple(r['best_at_cap'])} | "
                f"< {r['target_s']:.0f} s | {'yes' if r['meets_target_wall'] else 'no'} |")
    if result.get("baseline"):
        out += ["", "The same serial searches with the previous solver, in the same session:", "",
                "| case | solver | wall s | CPU s | load |", "|---|---|---|---|---|"]
        for b in result["baseline"]:
            out.append(f"| {b['case']} | {b['label']} | {b['wall_s']:.1f} | {b['cpu_s']:.1f} | "
                       f"{_load(b)} |")
        for r in result["runs"]:
            if r["workers"] == 1:
                out.append(f"| {r['case']} | this commit | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
                           f"{_load(r)} |")
    out += ["", "### Against the targets", ""]
    for r in result["runs"]:
        verdict = "meets" if r["meets_target_wall"] else "MISSES"
        out.append(f"- {r['case']}, {r['workers']} worker(s): {r['wall_s']:.1f} s wall, "
                   f"{r['cpu_s']:.1f} CPU-s vs the {r['target_s']:.0f} s target: {verdict} it "
                   f"(load {_load(r)} on {m['cpu_count']} CPUs).")
    for r in result.get("startup", []):
        verdict = "meets" if r["meets_target_wall"] else "MISSES"
        out.append(f"- start-up {r['case']} (cap {r['cap']}): {r['wall_s']:.1f} s wall vs "
                   f"~{r['target_s']:.0f} s: {verdict} it (load {_load(r)}).")
    out += ["", "### What changed and what is left", "", *NOTES, ""]
    return "\n".join(out)


NOTES = [
    "- **Start-up on measured latencies failed** (bench pair at delta 0.15 ms: 41 s at N = 10, then "
    "\"did not converge in 50000 sweeps\").  One GMRES shared by a batch of chains had to resolve "
    "every chain's spectrum at once (55 chains: ~400 steps where each alone needs 10-15) and its "
    "answer failed the strict non-negativity check; the power-method fallback crawls on these "
    "chains (the censored chain has eigenvalues -0.9994 and 0.9991: nearly periodic and nearly "
    "decomposable, 25k sweeps).  GMRES now keeps per-chain Krylov coefficients, rotations and "
    "stopping tests (only operator applications are shared); a chain that still fails is retried "
    "alone with a long restart, then by the power method for that chain only; the router keeps "
    "N - 1's B* when one N fails.",
    "- **delta from a state budget** (`dtmc.choose_delta`, default 6M states for the whole "
    "table): a chain's states are ~kappa * e_{M-1}(longest step of each model, in units of the "
    "gcd of all steps), kappa independent of delta within ~15 %; BFS-only probes calibrate kappa "
    "and the table/largest-chain ratio, and the most accurate candidate delta (smallest rounding "
    "error of the step latencies, exact multiples included) within budget is taken; its largest "
    "chain is counted exactly.  The estimate is conservative (actual 50-90 % of it).",
    "- **BFS**: a target's key is a sum of per-model table entries (the launch rule is in the "
    "tables), so only states seen for the first time are decoded; no chain-by-chain renumbering "
    "of the transitions.",
    "- **Solver matrices**: with states ordered [Y, F] the censored operator is one mat-vec and "
    "one unit lower triangular solve over all states, whose matrix is just the Y sources' "
    "columns of I - T (no split of the transitions by destination): one gather per transition.",
    "- **Batch sizes** follow the ratio of total states N-1 -> N (the largest per-chain ratio "
    "had cut M = 2 batches ~10x too small, per-level overhead then dominated).",
    "- **Left**: on one core these changes gain little on M = 3 (see the previous-solver rows): "
    "BFS (hash look-ups, ~75 ns per transition) and the triangular solves inside GMRES (50-60 "
    "applications for the largest M = 3 chains, ~3 ns per stored transition) are memory-bound "
    "numpy/SuperLU passes, so one core stays above the 30 s target; two worker processes bring "
    "it under when the second core is free (the per-N barrier costs little: CPU-s / wall ~1.95).  "
    "Tried and dropped (measured slower here): int32 index arrays (numpy converts them to intp on "
    "every gather), a hash insert without sort, a denser hash table (more probe rounds); "
    "per-chain triangular solves in a batch would save ~7 % of M = 3's GMRES work (51 % of "
    "M = 2's, which is small anyway).  A compiled BFS (numba) is the remaining big lever and "
    "was not added (a heavy dependency and a JIT at router start).",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--skip-m3", action="store_true")
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--baseline-src", default=None,
                    help="also time the serial searches with the aiorouter package found in this "
                    "folder (e.g. from `git archive REV aiorouter | tar -x -C DIR`)")
    ap.add_argument("--baseline-label", default="previous solver")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "dtmc_speed.json"))
    ap.add_argument("--markdown", default=str(ROOT / "bench" / "results" / "dtmc_speed.md"))
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
    baseline = []
    if args.baseline_src:
        for name in ["m2_r2r"] + ([] if args.skip_m3 else ["m3_me"]):
            baseline.append(dict(run_baseline(args.baseline_src, name), label=args.baseline_label))
            b = baseline[-1]
            print(f"\n== baseline {name} ({b['label']}): wall {b['wall_s']:.2f}s cpu {b['cpu_s']:.2f}s "
                  f"load {_load(b)}")
    startup = []
    if not args.skip_startup:
        for name in STARTUP:
            startup.append(run_startup(name))
            r = startup[-1]
            print(f"\n== start-up {name}: delta {r['delta_ms']} ms (rounding <= "
                  f"{100 * r['max_rounding_error']:.2f} %), {r['actual_states']:,} states "
                  f"(estimated {r['estimated_states']:,}), wall {r['wall_s']:.2f}s cpu "
                  f"{r['cpu_s']:.2f}s load {_load(r)}, B*({r['cap']}) = {tuple(r['best_at_cap'])}")
    result = dict(machine={**machine(), "parallel_speedup_probe": probe}, runs=runs,
                  startup=startup, baseline=baseline, generated=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    if args.markdown:
        Path(args.markdown).write_text(markdown(result))
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
