"""Against the baselines on CPU: aiorouter against Std. Serving, HF naive and single models.

    python -m bench.run --quick                  # every system and ratio, tiny settings (< 3 min)
    python -m bench.run                          # the full sweep
    python -m bench.run --pairs cpu-tiny --workloads low-effort --concurrency 1,4 --systems aiorouter,std-serving
    python -m bench.run report bench/results/full.json [TABLES.md]   # a saved run's tables and plots again
    aiorouter bench ...                          # the same, from the CLI

Systems (all in one process, interleaved per (workload, N) so drift hits them alike):
  aiorouter    Router, mode delayed, thresholds "auto"
  eager, sync  the same runtime in its eager-async and step-sync modes (ablation)
  std-serving  one single-model server per model + an outside token-level dispatcher, in process (bench/baselines.py)
  hf-naive     two transformers models, static lock-step batches (bench/baselines.py)
  large-alone, small-alone   one model through the runtime (policy "single")

Writes <out>/<name>.json (raw figures), <out>/<name>-*.png (plots) and the tables beside them:
<out>/<name>.md (bench/RESULTS.md quotes the figures it claims).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiorouter import heap
from aiorouter.cpu_threads import plan_threads
from bench import workloads as W
from bench.baselines import HFNaive, StdServing, make_rule, std_loop
from bench.common import (
    PAIRS, ROOT, LoopResult, OutsideLoad, Pair, commas, load_pair, machine, rel, router_loop, subcommands)
from policies import make_policy

SYSTEMS = ("aiorouter", "eager", "sync", "std-serving", "hf-naive", "large-alone", "small-alone")
LABELS = {"aiorouter": "aiorouter (delayed)", "eager": "aiorouter eager", "sync": "aiorouter sync",
          "std-serving": "Std. Serving", "hf-naive": "HF naive", "large-alone": "large alone",
          "small-alone": "small alone"}
CONCURRENCY = (1, 4, 8, 16)
ROUTER_MODES = {"aiorouter": "delayed", "eager": "eager", "sync": "sync"}
STD_PAGE_SIZE = 1  # Std. Serving's KV page: token-granular prefix cache (see --std-page-size)

# name, numerator, denominator, workload, N (numerator), N (denominator), target. Main targets on cpu-tiny.
RATIOS = (
    ("aiorouter / Std. Serving, N=4, low-effort", "aiorouter", "std-serving", "low-effort", 4, 4, 3.0),
    ("aiorouter / HF naive, N=4", "aiorouter", "hf-naive", "low-effort", 4, 4, 3.0),
    ("aiorouter / large model alone, N=4", "aiorouter", "large-alone", "low-effort", 4, 4, 1.5),
    ("eager / sync, N=4", "eager", "sync", "low-effort", 4, 4, 1.2),
    ("delayed / eager, N=8", "aiorouter", "eager", "low-effort", 8, 8, 1.1),
    ("throughput N=16 / N=1 (aiorouter)", "aiorouter", "aiorouter", "low-effort", 16, 1, 5.0),
)
RATIO_PAIR = "cpu-tiny"
# Every system first serves N warm-up requests (prompts outside the workload) at concurrency N:
# first calls of a batch shape (oneDNN primitives, allocator) are not what is measured.
WARMUP_TOKENS = 16


@dataclass
class Opts:
    kv_memory_gb: float
    requests_per_client: int
    min_requests: int
    hf_threads: int
    engine_config: dict


def num_requests(n: int, opts: Opts) -> int:
    return max(n * opts.requests_per_client, opts.min_requests)


def router_threads(num_models: int) -> int:
    """Intra-op threads of a lone model's worker (the single-model systems and the HF calibration)."""
    return max(1, (os.cpu_count() or 1) // num_models)


# -- one measured run per system ------------------------------------------------------------------
async def _router_run(pair: Pair, system: str, wl: W.Workload, n: int, total: int, opts: Opts) -> dict:
    from aiorouter import Router, RouterConfig
    if system in ROUTER_MODES:
        models = {"small": str(pair.small), "large": str(pair.large)}
        mode = ROUTER_MODES[system]
        kw = dict(policy=pair.policy, policy_args=pair.policy_args, entry="small", mode=mode,
                  thresholds="auto" if mode == "delayed" else {"small": 1, "large": 1})
    else:
        which = system.removesuffix("-alone")
        models = {which: str(pair.large if which == "large" else pair.small)}
        kw = dict(policy="single", mode="eager")
    async with Router(models, RouterConfig(kv_memory_gb=opts.kv_memory_gb, max_concurrency=max(n, 1), **kw)) as r:
        out = await router_loop(r, wl.prompts, n, total, wl.max_tokens, W.warmup_prompts(n, vocab=pair.vocab),
                                WARMUP_TOKENS)
        if system in ROUTER_MODES:
            out["thresholds"] = r.thresholds(n)
        return out


async def _std_run(pair: Pair, wl: W.Workload, n: int, total: int, opts: Opts) -> dict:
    policy = make_policy(pair.policy, pair.policy_args)
    async with StdServing({"small": pair.small, "large": pair.large}, policy, opts.kv_memory_gb,
                          opts.engine_config.get("page_size")) as std:
        return await std_loop(std.dispatcher, std.stats, wl.prompts, n, total, wl.max_tokens,
                              W.warmup_prompts(n, vocab=pair.vocab), WARMUP_TOKENS)


def _hf_run(hf: HFNaive, wl: W.Workload, n: int, total: int) -> dict:
    hf.generate(W.warmup_prompts(n), WARMUP_TOKENS)
    res = LoopResult()
    res._per_request = []
    small = large = 0
    forwards = {"small": 0, "large": 0}
    busy = {"small": 0.0, "large": 0.0}
    computed = {"small": 0, "large": 0}
    i = 0
    with heap.frozen():  # what Router.start does, for the baselines that have no Router
        t0 = time.perf_counter()
        while i < total:  # a closed loop of n clients = successive static batches of n
            batch = [wl.prompts[(i + k) % len(wl.prompts)] for k in range(min(n, total - i))]
            i += len(batch)
            b = hf.generate(batch, wl.max_tokens)
            forwards["small"] += b.small_forwards
            forwards["large"] += b.large_forwards
            busy["small"] += b.small_s
            busy["large"] += b.large_s
            computed["small"] += b.small_tokens
            computed["large"] += b.large_tokens
            for tr in b.traces:
                res.tokens += len(tr)
                res.ttft.append(b.t_first)
                res.e2e.append(b.seconds)
                res._per_request.append((len(tr), b.seconds))
                nl = sum(tr)
                large += nl
                small += len(tr) - nl
        res.seconds = time.perf_counter() - t0
    res.per_model = {"small": small, "large": large}
    out = res.summary()
    out["forwards"] = forwards
    out["threads"] = hf.threads
    out["tokens_computed"] = computed  # padded batch rows included
    out["busy"] = {k: v / res.seconds for k, v in busy.items()}
    out["step_ms"] = {k: 1000 * busy[k] / max(1, forwards[k]) for k in busy}
    out["mean_batch"] = {"small": float(n), "large": float(n)}  # static batches: every forward is the whole batch
    return out


def run_one(pair: Pair, system: str, wl: W.Workload, n: int, opts: Opts, hf: HFNaive | None) -> dict:
    total = num_requests(n, opts)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        with OutsideLoad() as outside:
            if system == "hf-naive":
                out = _hf_run(hf, wl, n, total)
            elif system == "std-serving":
                out = asyncio.run(_std_run(pair, wl, n, total, opts))
            else:
                out = asyncio.run(_router_run(pair, system, wl, n, total, opts))
        out["outside_cores"] = outside.cores  # CPU other processes used meanwhile: noise
    except Exception as e:  # one broken system must not sink the sweep
        import traceback
        traceback.print_exc()
        out = {"error": repr(e)}
    out["requests"] = total
    out["wall_s"] = time.perf_counter() - t0  # including start-up and warm-up
    out["load_avg_1min"] = [load0, os.getloadavg()[0]]  # at the run's start and end: others' load is noise
    gc.collect()
    return out


# -- HF naive's intra-op threads ----------------------------------------------------------------------
def _hf_threads(pair: Pair, choice: str, quick: bool) -> tuple[int, dict]:
    """HF naive may use up to `cores` intra-op threads (the total the runtime uses); "auto"
    times 1 and `cores` threads on a short lock-step batch and keeps the faster (on a busy
    machine several intra-op threads can be ten times slower than one)."""
    cores = os.cpu_count() or 1
    if choice != "auto":
        return int(choice), {}
    if cores == 1:
        return 1, {}
    hf = HFNaive(pair.small, pair.large, make_rule(pair.policy, pair.policy_args), cores)
    prompts = W.short_prompts(99, 2 if quick else 4, 32 if quick else 100, 8, min(pair.vocab, W.VOCAB))
    steps, reps = (4, 1) if quick else (24, 3)
    timing = {1: [], cores: []}
    for t in timing:
        hf.threads = t
        hf.generate(prompts, 2)
    for _ in range(reps):  # alternate, so a burst of outside load hits both settings
        for t in timing:
            hf.threads = t
            timing[t].append(hf.generate(prompts, steps).seconds)
    timing = {t: sorted(v)[len(v) // 2] for t, v in timing.items()}
    best = min(timing, key=timing.get)
    return best, {f"{t}_threads_s": round(s, 4) for t, s in timing.items()}


# -- ratios -------------------------------------------------------------------------------------------
def _tok_s(results: dict, pair: str, wl: str, n: int, system: str) -> float | None:
    r = results.get(pair, {}).get(wl, {}).get(str(n), {}).get(system)
    return r.get("tok_s") if r and not r.get("error") else None


def compute_ratios(results: dict) -> list[dict]:
    out = []
    for name, num, den, wl, n_num, n_den, target in RATIOS:
        a, b = _tok_s(results, RATIO_PAIR, wl, n_num, num), _tok_s(results, RATIO_PAIR, wl, n_den, den)
        value = a / b if a is not None and b else None
        out.append({"name": name, "pair": RATIO_PAIR, "workload": wl, "numerator": f"{num}@N={n_num}",
                    "denominator": f"{den}@N={n_den}", "target": target, "value": value,
                    "met": None if value is None else value >= target,
                    "margin_pct": None if value is None else 100.0 * (value / target - 1.0)})
    return out


def ratios_by_workload(results: dict) -> list[dict]:
    """The same ratios on every (pair, workload) measured: context, not targets."""
    rows = []
    for pair, wls in results.items():
        for wl in wls:
            for name, num, den, _, n_num, n_den, target in RATIOS:
                a, b = _tok_s(results, pair, wl, n_num, num), _tok_s(results, pair, wl, n_den, den)
                if a is not None and b:
                    rows.append({"name": name, "pair": pair, "workload": wl, "value": a / b, "target": target})
    return rows


# -- main ------------------------------------------------------------------------------------------------
def _outside_summary(results: dict) -> dict:
    xs = [r["outside_cores"] for wls in results.values() for cell in wls.values() for row in cell.values()
          for r in row.values() if r.get("outside_cores") is not None]
    return {"mean": sum(xs) / len(xs), "max": max(xs), "runs_over_0.25": sum(x > 0.25 for x in xs),
            "runs": len(xs)} if xs else {}


def outside_cores_now(window_s: float = 5.0) -> float | None:
    with OutsideLoad() as o:
        time.sleep(window_s)
    return o.cores


def wait_quiet(limit_s: float, max_cores: float) -> bool:
    """Wait until other processes use less than `max_cores` of CPU (over 5 s); False if
    `limit_s` passes first. (The load average would count this benchmark's own threads.)"""
    t0 = time.time()
    while True:
        c = outside_cores_now()
        if c is None or c < max_cores:
            return True
        if time.time() - t0 > limit_s:
            print(f"\nthe machine did not get quiet (others use {c:.2f} cores); running anyway", flush=True)
            return False


def _noise(rows: dict) -> float:
    """The worst outside CPU use (cores) over a group's runs; errors count as noisy."""
    return max((r.get("outside_cores") or 0.0) if not r.get("error") else 99.0 for r in rows.values()) if rows else 99.0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="aiorouter bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="every system and ratio on tiny settings (< 3 min)")
    ap.add_argument("--pairs", default=None, help=f"comma list of {', '.join(PAIRS)} (default: all; quick: cpu-tiny)")
    ap.add_argument("--workloads", default=None, help=f"comma list of {', '.join(W.WORKLOADS)} (quick: low-effort)")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)), help="comma list of N")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    ap.add_argument("--requests-per-client", type=int, default=None, help="closed-loop requests per client (default 1)")
    ap.add_argument("--min-requests", type=int, default=None, help="at least this many requests per run (default 2; quick 1)")
    ap.add_argument("--kv-memory-gb", type=float, default=4.0, help="KV memory of a system, split across its models")
    ap.add_argument("--std-page-size", type=int, default=STD_PAGE_SIZE,
                    help="KV page size of the Std. Serving servers: 1 (default) = token-granular prefix cache, "
                         "like SGLang's radix cache; measured faster for this baseline than 16 (the runtime's)")
    ap.add_argument("--hf-threads", default="auto", help="HF naive intra-op threads: a number or auto (the faster of 1 and cores)")
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--name", default=None, help="JSON/plot name (default full, or quick)")
    ap.add_argument("--md", default=None, help="tables file (default <out>/<name>.md)")
    ap.add_argument("--merge", action="store_true", help="merge into an existing <out>/<name>.json instead of replacing it")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="MINUTES",
                    help="before each (pair, workload, N) group, wait up to MINUTES until other processes use "
                         "less than --quiet-cores of CPU")
    ap.add_argument("--quiet-cores", type=float, default=0.25,
                    help="other processes' CPU (cores) above which a run counts as noisy (default 0.25)")
    ap.add_argument("--retries", type=int, default=0,
                    help="rerun a (pair, workload, N) group up to this many times while it is noisy; keep the cleanest")
    ap.add_argument("--redo-noisy", action="store_true",
                    help="with --merge: run only the groups missing or noisy in the existing JSON")
    return ap


def sweep(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    quick = args.quick
    pair_names = commas(args.pairs or ("cpu-tiny" if quick else ",".join(PAIRS)), allowed=PAIRS)
    wl_names = commas(args.workloads or ("low-effort" if quick else ",".join(W.WORKLOADS)), allowed=W.WORKLOADS)
    ns = commas(args.concurrency, int)
    systems = commas(args.systems, allowed=SYSTEMS)
    rpc = args.requests_per_client or 1
    min_req = args.min_requests or (1 if quick else 2)
    out_dir = Path(args.out) if args.out else ROOT / "bench" / "results"
    name = args.name or ("quick" if quick else "full")
    md = Path(args.md) if args.md else out_dir / f"{name}.md"
    out_dir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    print(f"aiorouter bench: pairs {pair_names}, workloads {wl_names}, N {ns}, systems {systems}; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    if load[0] > 1.5 and not quick:
        print("warning: the machine is busy (load average > 1.5): figures will carry that noise", flush=True)

    t_start = time.perf_counter()
    pairs = [load_pair(p) for p in pair_names]
    opts_by_pair, hfs, hf_cal = {}, {}, {}
    for pair in pairs:
        threads, cal = 0, {}
        if "hf-naive" in systems:
            if args.wait_quiet > 0 and args.hf_threads == "auto":
                wait_quiet(args.wait_quiet * 60, args.quiet_cores)
            threads, cal = _hf_threads(pair, args.hf_threads, quick)
            hf_cal[pair.name] = {"threads": threads, **cal}
        opts_by_pair[pair.name] = Opts(args.kv_memory_gb, rpc, min_req, threads,
                                       {"page_size": args.std_page_size})
        if "hf-naive" in systems:
            hfs[pair.name] = HFNaive(pair.small, pair.large, make_rule(pair.policy, pair.policy_args), threads)
    wls = {p.name: {w: W.make(w, quick, vocab=p.vocab) for w in wl_names} for p in pairs}
    plan = [(p, wls[p.name][w], n, s) for p in pairs for w in wl_names for n in ns for s in systems]

    path = out_dir / f"{name}.json"
    results: dict = {}
    prev: dict = {}
    if args.merge and path.is_file():
        prev = json.loads(path.read_text())
        results = prev.get("results", {})
    from tqdm import tqdm
    t_sweep = time.perf_counter()
    groups = [(p, wls[p.name][w], n) for p in pairs for w in wl_names for n in ns]
    with tqdm(total=len(plan), desc="bench", unit="run") as bar:
        for pair, wl, n in groups:  # systems innermost: interleaved per (workload, N), drift hits them alike
            cell = results.setdefault(pair.name, {}).setdefault(wl.name, {}).setdefault(str(n), {})
            if args.redo_noisy and all(s in cell for s in systems) and \
                    _noise({s: cell[s] for s in systems}) <= args.quiet_cores:
                bar.update(len(systems))
                continue
            best, best_noise = None, None
            for attempt in range(1 + max(0, args.retries)):
                if attempt:
                    bar.total += len(systems)
                    bar.refresh()
                if args.wait_quiet > 0:
                    bar.set_postfix_str(f"{pair.name} {wl.name} N={n}: waiting for a quiet machine")
                    wait_quiet(args.wait_quiet * 60, args.quiet_cores)
                rows = {}
                for s in systems:
                    bar.set_postfix_str(f"{pair.name} {wl.name} N={n} {s}" + (f" (retry {attempt})" if attempt else ""))
                    rows[s] = run_one(pair, s, wl, n, opts_by_pair[pair.name], hfs.get(pair.name))
                    bar.update(1)
                noise = _noise(rows)
                if best is None or noise < best_noise:
                    best, best_noise = rows, noise
                if noise <= args.quiet_cores:
                    break
            cell.update(best)
            path.write_text(json.dumps({"partial": True, "results": results}, indent=1, default=str))  # crash-safe
    sweep_s = time.perf_counter() - t_sweep

    cores = os.cpu_count() or 1
    data = {
        "machine": {**machine(), "load_avg_start": load, "load_avg_end": os.getloadavg()},
        "config": {
            "quick": quick, "pairs": pair_names, "workloads": wl_names, "concurrency": ns, "systems": systems,
            "requests_per_client": rpc, "min_requests": min_req, "kv_memory_gb": args.kv_memory_gb,
            "quiet_cores": args.quiet_cores, "wait_quiet_min": args.wait_quiet, "retries": args.retries,
            "temperature": 0.0, "ignore_eos": True,
            "threads": {
                "total": cores,
                "aiorouter/eager/sync": "per model worker: small {}, large {} intra-op thread(s) "
                                        "(aiorouter.cpu_threads); while a small step runs, the large "
                                        "model's team shrinks to the cores left (CoreShare)".format(*plan_threads([0, 1], cores)),
                "std-serving": "per server worker: the same plan as aiorouter's, CoreShare included",
                "large-alone/small-alone": f"{router_threads(1)} intra-op thread(s), one model worker",
                "hf-naive": {p: f"{c['threads']} intra-op thread(s), both models on one thread in turn" +
                             (f" (auto: faster of 1 and {cores}; calibration {c})" if len(c) > 1 else "")
                             for p, c in hf_cal.items()},
                "policy": f"every system may use all {cores} cores; none gets more",
            },
            "engine": "engines.Engine defaults (page_size 16, prefix caching on) for aiorouter and single models; "
                      f"Std. Serving page_size {args.std_page_size}",
        },
        "pairs": {**prev.get("pairs", {}), **{p.name: {"small": str(p.small), "large": str(p.large), "policy": p.policy,
                                                        "policy_args": p.policy_args, **p.notes} for p in pairs}},
        "workloads": {**prev.get("workloads", {}), **({w: wls[pairs[0].name][w].describe() for w in wl_names} if pairs else {})},
        "systems": {s: LABELS[s] for s in SYSTEMS},
        "results": results,
        "ratios": compute_ratios(results),
        "ratios_by_workload": ratios_by_workload(results),
        "outside_cores": _outside_summary(results),
        "sweep_s": sweep_s,
        "duration_s": time.perf_counter() - t_start,
    }
    measured = {s for wls_ in results.values() for cell in wls_.values() for row in cell.values() for s in row}
    data["config"]["systems"] = [s for s in SYSTEMS if s in measured or s in systems]
    # closed-loop depth per (pair, workload) block: merged blocks may come from invocations with another
    blocks = dict(prev.get("config", {}).get("requests_per_client_by_block", {}))
    if prev and not blocks:  # blocks merged before this was recorded ran at the then-only setting
        blocks = {f"{p}/{w}": prev["config"].get("requests_per_client", 1) for p, ws in results.items() for w in ws}
    blocks.update({f"{p.name}/{w}": rpc for p in pairs for w in wl_names})
    data["config"]["requests_per_client_by_block"] = blocks
    if prev:
        data["config"]["merged_from_earlier_invocations"] = True
    data["json_path"] = rel(path)
    path.write_text(json.dumps(data, indent=2, default=str))
    write_report(data, out_dir, name, md)
    print(ratio_table(data["ratios"]))
    print(f"wrote {path}, {md} and the plots in {data['duration_s']:.0f} s", flush=True)
    return 0


# -- the report: a run's tables -------------------------------------------------------------------------
def _f(x, nd: int = 1, scale: float = 1.0) -> str:
    return "-" if x is None else f"{x * scale:.{nd}f}"


def ratio_table(ratios: list[dict]) -> str:
    lines = ["| ratio (cpu-tiny, random p=0.35, same run) | measured | target | met? | by how much |",
             "|---|---|---|---|---|"]
    for r in ratios:
        v = r.get("value")
        if v is None:
            lines.append(f"| {r['name']} | not measured | >= {r['target']:g}x | - | - |")
            continue
        margin = r["margin_pct"]
        verdict = "met" if r["met"] else "**missed**"
        how = f"{margin:+.0f}% vs target" if r["met"] else f"{-margin:.0f}% short ({v:.2f}x of {r['target']:g}x)"
        lines.append(f"| {r['name']} ({r['numerator']} / {r['denominator']}) | {v:.2f}x | >= {r['target']:g}x | "
                     f"{verdict} | {how} |")
    return "\n".join(lines)


def results_table(data: dict, pair: str, wl: str) -> str:
    cell = data["results"][pair][wl]
    labels = data.get("systems", {})
    lines = ["| N | system | tok/s | TTFT p50 (ms) | TTFT p90 (ms) | e2e p50 (s) | e2e p90 (s) | per-user tok/s | "
             "small % | large % | mean batch (small/large) | busy % (small/large) | requests | others' CPU (cores) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in sorted(cell, key=int):
        for s in data["config"]["systems"]:
            r = cell[n].get(s)
            if r is None:
                continue
            if r.get("error"):
                lines.append(f"| {n} | {labels.get(s, s)} | error: {r['error'][:80]} |" + " |" * 11)
                continue
            frac = r.get("model_fraction") or {}
            mb = r.get("mean_batch") or {}
            mbs = "/".join(_f(mb.get(k), 1) for k in ("small", "large") if k in mb)
            bz = r.get("busy") or {}
            bzs = "/".join(_f(bz.get(k), 0, 100) for k in ("small", "large") if k in bz)
            lines.append(f"| {n} | {labels.get(s, s)} | {_f(r['tok_s'])} | {_f(r['ttft_p50'], 0, 1e3)} | "
                         f"{_f(r['ttft_p90'], 0, 1e3)} | {_f(r['e2e_p50'], 2)} | {_f(r['e2e_p90'], 2)} | "
                         f"{_f(r.get('per_user_tok_s'))} | {_f(frac.get('small'), 0, 100)} | "
                         f"{_f(frac.get('large'), 0, 100)} | {mbs or '-'} | {bzs or '-'} | {r.get('requests', '-')} | "
                         f"{_f(r.get('outside_cores'), 2)} |")
    return "\n".join(lines)


def by_workload_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    names = list(dict.fromkeys(r["name"] for r in rows))
    cols = list(dict.fromkeys((r["pair"], r["workload"]) for r in rows))
    val = {(r["name"], r["pair"], r["workload"]): r["value"] for r in rows}
    lines = ["| ratio | target | " + " | ".join(f"{p} {w}" for p, w in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    tgt = {r["name"]: r["target"] for r in rows}
    for n in names:
        lines.append(f"| {n} | >= {tgt[n]:g}x | " + " | ".join(_f(val.get((n, p, w)), 2) + ("x" if (n, p, w) in val else "")
                                                          for p, w in cols) + " |")
    return "\n".join(lines)


def _system_of(spec: str) -> tuple[str, str]:
    s, n = spec.split("@N=")
    return s, n


def breakdown_table(data: dict) -> str:
    """For every ratio: where each side's time went (from the run's own counters)."""
    lines = ["| ratio | system @ N | tok/s | mean batch (small/large) | step ms (small/large) | busy % (small/large) | "
             "tokens computed per output token (small/large) |", "|---|---|---|---|---|---|---|"]
    any_row = False
    for r in data["ratios"]:
        cell = data["results"].get(r["pair"], {}).get(r["workload"], {})
        for spec in (r["numerator"], r["denominator"]):
            s, n = _system_of(spec)
            row = cell.get(n, {}).get(s)
            if not row or row.get("error"):
                continue
            any_row = True
            pick = lambda d, nd=1, sc=1.0: "/".join(_f((d or {}).get(k), nd, sc) for k in ("small", "large") if k in (d or {})) or "-"
            tc = row.get("tokens_computed")
            per = {k: v / max(1, row["tokens"]) for k, v in tc.items()} if tc else None
            lines.append(f"| {r['name']} | {data.get('systems', {}).get(s, s)} @ {n} | {_f(row['tok_s'])} | "
                         f"{pick(row.get('mean_batch'))} | {pick(row.get('step_ms'))} | {pick(row.get('busy'), 0, 100)} | "
                         f"{pick(per, 2)} |")
    return "\n".join(lines) if any_row else ""


def render(data: dict, pngs: list | None = None, notes: str | None = None) -> str:
    m, c = data["machine"], data["config"]
    title = "quick run (tiny settings: the figures are not meaningful)" if c.get("quick") else "full sweep"
    la = lambda x: " ".join(f"{v:.2f}" for v in x) if x else "-"
    out = [f"# aiorouter benchmark: {title}", "",
           "Generated by `python -m bench.run` from "
           f"`{data.get('json_path', 'bench/results/' + ('quick' if c.get('quick') else 'full') + '.json')}`.", "",
           f"- machine: {m.get('cpu')}, {m.get('cores')} cores, torch {m.get('torch')}, Python {m.get('python')}",
           f"- commit: `{m.get('commit')}`, {m.get('time')}",
           f"- load average at start: {la(m.get('load_avg_start'))}; at end: {la(m.get('load_avg_end'))} "
           "(1, 5, 15 min; the CPU is shared, so figures above ~1.5 carry others' load)",
           "- other processes' CPU use during the runs (cores, measured from /proc/stat minus this process): "
           + (", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in data["outside_cores"].items())
              if data.get("outside_cores") else "-"),
           (f"- this invocation's sweep: {data.get('sweep_s', 0) / 60:.1f} min (the tables also hold blocks "
            "measured by earlier invocations, merged)" if c.get("merged_from_earlier_invocations")
            else f"- sweep: {data.get('sweep_s', 0) / 60:.1f} min") +
           (f" (estimated {data['estimate_s'] / 60:.1f} min)" if data.get("estimate_s") else ""),
           "- closed loop: " + (", ".join(f"{b} {v}" for b, v in c["requests_per_client_by_block"].items()) + " "
                                if len(set(c.get("requests_per_client_by_block", {}).values())) > 1
                                else f"{c['requests_per_client']} ")
           + f"request(s) per client, at least {c['min_requests']} per run; "
           f"greedy, fixed output lengths (ignore_eos); KV memory {c['kv_memory_gb']} GB per system",
           "- threads: " + "; ".join(f"{k}: {v}" for k, v in c["threads"].items() if k != "hf-naive")
           + "; hf-naive: " + "; ".join(f"{p}: {v}" for p, v in (c["threads"].get("hf-naive") or {}).items()),
           "- pairs: " + "; ".join(f"{p}: small `{Path(v['small']).name}`, large `{Path(v['large']).name}`, "
                                   f"{v['policy']} {v['policy_args']}" for p, v in data["pairs"].items()),
           "- workloads: " + "; ".join(f"{w}: {v['description']}" for w, v in data["workloads"].items()),
           "", "## Targets", "", ratio_table(data["ratios"]), ""]
    bd = breakdown_table(data)
    if bd:
        out += ["### Where the time goes (each ratio's two sides)", "",
                "busy = share of the measured run a model's worker spent inside steps; tokens computed = tokens a "
                "model ran through its layers (prompt prefill and catch-up extends included) per output token.", "",
                bd, ""]
    bw = by_workload_table(data.get("ratios_by_workload") or [])
    if bw:
        out += ["## The same ratios on every pair and workload (context)", "",
                "Every pair routes with its own policy (the header's `pairs` line), so the token fractions "
                "differ from cpu-tiny's.", "", bw, ""]
    for pair, wls in data["results"].items():
        for wl in wls:
            out += [f"## {pair}, {wl}", "", results_table(data, pair, wl), ""]
    if pngs:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in pngs] + [""]
    if notes:
        out += [notes.strip(), ""]
    return "\n".join(out)


def write_report(data: dict, out_dir: Path, name: str, md: Path) -> None:
    """A run's plots as `out_dir`/`name`-*.png and its tables as `md`, which links them."""
    from bench import plots
    pngs = plots.make_all(data, out_dir, name)
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(render(data, [p.relative_to(md.parent) if p.is_relative_to(md.parent) else p for p in pngs],
                         data.get("notes")))


def report(argv: list[str]) -> int:
    """`python -m bench.run report RUN.json [TABLES.md]`: a saved run's tables (default: beside it) and plots."""
    ap = argparse.ArgumentParser(prog="python -m bench.run report", description=report.__doc__)
    ap.add_argument("json", type=Path, nargs="?", default=ROOT / "bench" / "results" / "full.json")
    ap.add_argument("md", type=Path, nargs="?", default=None)
    args = ap.parse_args(argv)
    data = json.loads(args.json.read_text())
    data.setdefault("json_path", str(args.json))
    md = args.md or args.json.with_suffix(".md")
    write_report(data, args.json.parent, args.json.stem, md)
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    return subcommands(argv, sweep, report=report)


if __name__ == "__main__":
    raise SystemExit(main())
