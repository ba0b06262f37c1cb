"""The benchmark harness: aiorouter against Std. Serving, HF naive and single models.

    python -m bench.run --quick                  # every system and ratio, tiny settings (< 3 min)
    python -m bench.run                          # the full sweep (prints its expected duration first)
    python -m bench.run --pairs cpu-tiny --workloads low-effort --concurrency 1,4 --systems aiorouter,std-serving
    aiorouter bench ...                          # the same, from the CLI

Systems (all in one process, interleaved per (workload, N) so drift hits them alike):
  aiorouter    Router, mode delayed, thresholds "auto"
  eager, sync  the same runtime in its eager-async and step-sync modes (ablation)
  std-serving  one single-model server per model + an outside token-level dispatcher, in process (bench/std_serving.py)
  hf-naive     two transformers models, static lock-step batches (bench/baselines.py)
  large-alone, small-alone   one model through the runtime (policy "single")

Writes <out>/<name>.json (raw figures), <out>/<name>-*.png (plots) and the tables beside them
(bench/report.py): <out>/<name>.md (bench/RESULTS.md quotes the figures it claims).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from aiorouter.cpu_threads import plan_threads
from bench import workloads as W
from bench.baselines import HFNaive, make_rule
from bench.std_serving import StdServing, server_delta
from policies import make_policy
from aiorouter import heap
from bench.common import ROOT, LoopResult, OutsideLoad, cache_dir, closed_loop, machine, tiny_qwen3

SYSTEMS = ("aiorouter", "eager", "sync", "std-serving", "hf-naive", "large-alone", "small-alone")
LABELS = {"aiorouter": "aiorouter (delayed)", "eager": "aiorouter eager", "sync": "aiorouter sync",
          "std-serving": "Std. Serving", "hf-naive": "HF naive", "large-alone": "large alone",
          "small-alone": "small alone"}
PAIRS = ("cpu-tiny", "smollm2")
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
class Pair:
    name: str
    small: Path
    large: Path
    policy: str
    policy_args: dict
    vocab: int
    notes: dict = field(default_factory=dict)


def load_pair(name: str) -> Pair:
    if name == "cpu-tiny":
        return Pair(name, tiny_qwen3("small"), tiny_qwen3("large"), "random", {"p": 0.35, "seed": 7}, 4096)
    if name == "smollm2":
        from engines.default_model import truncated_model_path
        from engines.known_models import default_model_path
        large = default_model_path()
        small = truncated_model_path(large, 10)
        vocab = json.loads((large / "config.json").read_text())["vocab_size"]
        # tau where the pair splits its tokens like cpu-tiny's random p = 0.35 (bench/tau.py), from
        # prompts drawn like low-effort's but not the measured ones
        from bench.tau import calibrate
        cal = calibrate(small, large, W.short_prompts(seed=123, count=4, vocab=min(vocab, W.VOCAB)),
                        cache=cache_dir() / "bench-tau")
        return Pair(name, small, large, "rstitch", {"tau": cal["tau"]}, vocab, {"tau_calibration": cal})
    raise ValueError(f"unknown pair {name!r}; choose from {', '.join(PAIRS)}")


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
        async def send(p, max_tokens=wl.max_tokens):
            async for ev in r.stream(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                yield ev.model

        wait_tuned = getattr(r, "wait_tuned", None)
        if wait_tuned is not None:  # measure the tuned thresholds, not the B=1 stand-in used while solving
            await wait_tuned()
        await closed_loop(lambda p: send(p, WARMUP_TOKENS), n, W.warmup_prompts(n, vocab=pair.vocab), n)
        for m in r.metrics.models.values():  # measure the run only
            m.steps, m.step_time_sum, m.admission_delay_sum, m.admission_delay_count = 0, 0.0, 0.0, 0
            m.batch_sizes.clear()
        r.metrics.handoffs.clear()
        before = tokens_computed(r)
        res = await closed_loop(send, n, wl.prompts, total)
        computed = {k: v - before[k] for k, v in tokens_computed(r).items()}
        out = res.summary()
        out["tokens_computed"] = dict(computed)  # tokens each model ran through its layers (extends included)
        if system in ROUTER_MODES:
            out["thresholds"] = r.thresholds(n)
            out["handoffs"] = sum(r.metrics.handoffs.values())
        out["mean_batch"] = {k: m.mean_batch_size for k, m in r.metrics.models.items()}
        out["steps"] = {k: m.steps for k, m in r.metrics.models.items()}
        out["step_ms"] = {k: 1000 * m.step_time_sum / max(1, m.steps) for k, m in r.metrics.models.items()}
        out["busy"] = {k: m.step_time_sum / res.seconds for k, m in r.metrics.models.items()}  # share of the run inside steps
        out["admission_delay_ms"] = {k: 1000 * m.mean_admission_delay for k, m in r.metrics.models.items()}
        return out


def tokens_computed(r) -> dict[str, int]:
    """Tokens each model has run through its layers so far (prefill, decode and catch-up extends)."""
    return {s.name: s.engine.stats.num_prefill_tokens + s.engine.stats.num_decode_tokens for s in r.subservers}


async def _std_run(pair: Pair, wl: W.Workload, n: int, total: int, opts: Opts) -> dict:
    policy = make_policy(pair.policy, pair.policy_args)
    async with StdServing({"small": pair.small, "large": pair.large}, policy, opts.kv_memory_gb,
                          opts.engine_config.get("page_size")) as std:
        await closed_loop(lambda p: std.stream(p, WARMUP_TOKENS), n, W.warmup_prompts(n, vocab=pair.vocab), n)
        before = std.stats()
        with heap.frozen():  # what Router.start does, for the baselines that have no Router
            res = await closed_loop(lambda p: std.stream(p, wl.max_tokens), n, wl.prompts, total)
        out = res.summary()
        after = std.stats()
        out["servers"] = {k: server_delta(before[k], after[k]) for k in after}
        out["busy"] = {k: v["busy_s"] / res.seconds for k, v in out["servers"].items()}
        out["tokens_computed"] = {k: v["prefill_tokens"] + v["decode_tokens"] for k, v in out["servers"].items()}
        out["step_ms"] = {k: 1000 * v["busy_s"] / max(1, v["steps"]) for k, v in out["servers"].items()}
        out["mean_batch"] = {k: v["mean_batch"] for k, v in out["servers"].items()}
        return out


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


# -- calibration and the duration estimate ----------------------------------------------------------
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


def calibrate(pairs: list[Pair], systems: list[str], opts_by_pair: dict, hfs: dict) -> dict:
    """Short runs at N=1 and N=4 (16 tokens, low-effort prompts) -> tok/s per system, fitted as
    a * N^b, plus each model's prefill speed, for the duration estimate."""
    cal = {}
    for pair in pairs:
        opts = opts_by_pair[pair.name]
        wl = W.Workload("calibration", W.short_prompts(7, 8, 100, 20, min(pair.vocab, W.VOCAB)), 16)
        c = {}
        for s in systems:
            pts = {}
            for n in (1, 4):
                o = Opts(opts.kv_memory_gb, 1, n, opts.hf_threads, opts.engine_config)
                r = run_one(pair, s, wl, n, o, hfs.get(pair.name))
                pts[n] = (r.get("tok_s") or 1.0, r["wall_s"] - r.get("seconds", 0.0))
            b = math.log(max(pts[4][0], 1e-6) / max(pts[1][0], 1e-6)) / math.log(4)
            c[s] = {"a": pts[1][0], "b": max(0.0, min(1.0, b)), "overhead_s": max(pts[1][1], pts[4][1])}
        c["prefill_s_per_token"] = _prefill_cost(pair)
        cal[pair.name] = c
    return cal


def _prefill_cost(pair: Pair) -> dict:
    from engines import Engine, EngineConfig
    out = {}
    prev = torch.get_num_threads()
    torch.set_num_threads(router_threads(2))
    try:
        for which, path in (("small", pair.small), ("large", pair.large)):
            eng = Engine(path, config=EngineConfig(num_kv_tokens=8192, enable_prefix_caching=False), load_tokenizer=False)
            p = W.short_prompts(5, 1, 512, 0, min(pair.vocab, W.VOCAB))[0]
            eng.generate(p[:64], max_tokens=1)
            t0 = time.perf_counter()
            eng.generate(p, max_tokens=1)
            out[which] = (time.perf_counter() - t0) / len(p)
    finally:
        torch.set_num_threads(prev)
    return out


def estimate(plan: list[tuple], cal: dict, opts_by_pair: dict) -> float:
    total = 0.0
    for pair, wl, n, s in plan:
        c = cal[pair.name]
        sc = c[s]
        reqs = num_requests(n, opts_by_pair[pair.name])
        tok_s = sc["a"] * n ** sc["b"]
        decode = reqs * wl.max_tokens / max(tok_s, 1e-6)
        pf = c["prefill_s_per_token"]
        per_tok = {"small-alone": pf["small"], "large-alone": pf["large"]}.get(s, pf["small"] + pf["large"])
        prefill = reqs * wl.mean_prompt_len * per_tok
        if wl.name == "agentic" and s != "hf-naive":
            prefill *= 0.5  # prefix caching (shared preamble, earlier turns): a rough guess
        total += decode + prefill + sc["overhead_s"]
    return total


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
def _csv(s: str, allowed: tuple | None = None, conv=str) -> list:
    items = [conv(x.strip()) for x in s.split(",") if x.strip()]
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise SystemExit(f"unknown {bad[0]!r}; choose from {', '.join(map(str, allowed))}")
    return items


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
    ap.add_argument("--no-estimate", action="store_true", help="skip the calibration and duration estimate")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="MINUTES",
                    help="before each (pair, workload, N) group, wait up to MINUTES until other processes use "
                         "less than --quiet-cores of CPU")
    ap.add_argument("--quiet-cores", type=float, default=0.25,
                    help="other processes' CPU (cores) above which a run counts as noisy (default 0.25)")
    ap.add_argument("--retries", type=int, default=0,
                    help="rerun a (pair, workload, N) group up to this many times while it is noisy; keep the cleanest")
    ap.add_argument("--redo-noisy", action="store_true",
                    help="with --merge: run only the groups missing or noisy in the existing JSON")
    ap.add_argument("--estimate-only", action="store_true", help="calibrate, print the expected duration, exit")
    ap.add_argument("--yes", action="store_true", help="(accepted for scripts; the sweep never asks)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quick = args.quick
    pair_names = _csv(args.pairs or ("cpu-tiny" if quick else ",".join(PAIRS)), PAIRS)
    wl_names = _csv(args.workloads or ("low-effort" if quick else ",".join(W.WORKLOADS)), W.WORKLOADS)
    ns = _csv(args.concurrency, None, int)
    systems = _csv(args.systems, SYSTEMS)
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

    est = None
    if not (quick or args.no_estimate):
        print("calibrating (short runs at N=1 and N=4) ...", flush=True)
        cal = calibrate(pairs, systems, opts_by_pair, hfs)
        est = estimate(plan, cal, opts_by_pair)
        print(f"expected duration: ~{est / 60:.0f} min for {len(plan)} runs "
              f"(calibration took {time.perf_counter() - t_start:.0f} s)", flush=True)
        if args.estimate_only:
            per = {}
            for p, w, n, sy in plan:
                per[(p.name, w.name)] = per.get((p.name, w.name), 0.0) + estimate([(p, w, n, sy)], cal, opts_by_pair)
            for (p, w), sec in per.items():
                print(f"  {p} {w}: ~{sec / 60:.1f} min")
            print(json.dumps(cal, indent=1))
            return 0

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
        "estimate_s": est,
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
    data["json_path"] = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    path.write_text(json.dumps(data, indent=2, default=str))
    from bench import plots, report
    pngs = plots.make_all(data, out_dir, name)
    report.write(data, md, [p.relative_to(md.parent) if p.is_relative_to(md.parent) else p for p in pngs])
    print(report.ratio_table(data["ratios"]))
    print(f"wrote {path}, {md} and {len(pngs)} plots in {data['duration_s']:.0f} s"
          + (f" (estimated {est:.0f} s)" if est else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
