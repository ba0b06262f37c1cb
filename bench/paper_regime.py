"""The paper's comparison in its own regime (section 5.1): Std. Serving as the paper built it, GPU step
times, long outputs.

    python -m bench.paper_regime --quick                 # under 5 minutes: sim N = 1, 4, 16 at two lengths, cpu-tiny N = 4
    python -m bench.paper_regime                         # the full sweep (resumable: --resume)
    python -m bench.paper_regime --pairs sim --systems aiorouter-delayed,std-serving-http --concurrency 4

Pairs: `sim` -- both models are `SimEngine`s that sleep the paper's measured decode steps (small
6.0 ms, large 27.9 ms; Qwen3-0.6B and Qwen3-32B on A100s), so a step waits without taking the
cores, as a GPU step does; `cpu-tiny` and `smollm2` -- the real pairs on this CPU. Every pair
routes with `random` p = 0.35 (the paper's throughput-model validation setting).

Systems: aiorouter-delayed / -eager / -sync (the runtime in each mode), std-serving-http (one
server process per model and a per-token dispatcher here, bench/baselines.py), std-serving-inproc
(the same servers and dispatcher in this process), large-alone.

Writes DIR/paper_regime.json ({"runs": [...]}, one object per run) after every run, and at the end
the targets, the paper's figures beside ours and every table as DIR/paper_regime.md.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import workloads as W
from bench.common import RESULTS, OutsideLoad, commas, machine, pair_paths, rel, router_loop, write_atomic

SYSTEMS = ("aiorouter-delayed", "aiorouter-eager", "aiorouter-sync", "std-serving-http", "std-serving-inproc",
           "large-alone")
PAIRS = ("sim", "cpu-tiny", "smollm2")
POLICY, POLICY_ARGS = "random", {"p": 0.35, "seed": 7}
SIM_MS = {"small": 6.0, "large": 27.9}  # the paper's measured decode steps (throughput-model validation)
SIM_VOCAB = 512
WARMUP_TOKENS = 16  # every system first serves N requests of this many tokens (at most the run's) at concurrency N
# Std. Serving's KV page, the faster for it: on the sim, 16 (a fresh request's prefix match hashes
# 1/16 as many pages; the <= 15 tokens it recomputes cost a sim step nothing), measured at N = 16,
# 128 tokens: 418 tok/s against 365 with page 1. On CPU, 1 (bench/run.py STD_PAGE_SIZE).
STD_PAGE = {"sim": 16, "real": 1}
KEY = ("engine", "pair", "workload", "max_tokens", "N", "system")


@dataclass
class Pair:
    name: str
    engine: str  # "sim" | "real"
    models: dict[str, object]  # small, large: a checkpoint path or a sim ModelSpec dict
    vocab: int
    kv_memory_gb: float = 4.0
    http_models: dict[str, str] = field(default_factory=dict)  # the --model of each token server
    std_threads: dict[str, int] = field(default_factory=dict)  # intra-op threads per server process
    thresholds: object = "auto"  # delayed mode's thresholds
    notes: dict = field(default_factory=dict)


def sim_pair(slope_ms: tuple[float, float], cap: int = 16) -> Pair:
    ecfg = {"num_kv_tokens": 1 << 19, "max_model_len": 16384}  # sim KV is bookkeeping only
    models, http = {}, {}
    for (name, ms), c in zip(SIM_MS.items(), slope_ms):
        a = ms - c  # L(1) is the paper's figure
        models[name] = {"engine": "sim", "latency_ms": a, "latency_slope_ms": c, "vocab_size": SIM_VOCAB,
                        "engine_config": ecfg}
        http[name] = f"sim:{a}:{c}"
    pair = Pair("sim", "sim", models, SIM_VOCAB, http_models=http, std_threads={"small": 1, "large": 1})
    pair.thresholds, pair.notes["dtmc"] = solve_sim_thresholds(slope_ms, cap)
    return pair


def solve_sim_thresholds(slope_ms: tuple[float, float], cap: int = 16) -> tuple[dict, dict]:
    """Delayed-batching thresholds for the sim pair, solved once from its exact step times with the
    tuner `thresholds="auto"` runs on profiled ones (the solve is seconds per router otherwise),
    and the throughput model's prediction for every N (the bound a runtime can approach)."""
    from aiorouter.tuning import LatencyModel, SystemSpec, choose_delta, threshold_table
    from policies import make_policy
    P, C = make_policy(POLICY, POLICY_ARGS).routing_template()
    lats = [LatencyModel((ms - c) / 1e3, c / 1e3) for ms, c in zip(SIM_MS.values(), slope_ms)]
    delta = choose_delta(P, lats, cap).delta
    table = threshold_table(SystemSpec.build(P, C, lats, delta), cap)
    thresholds = {n: dict(zip(SIM_MS, table.best(n))) for n in table.concurrencies}
    dtmc = {"delta_ms": delta * 1e3, "solve_s": table.seconds,
            "by_N": {n: {"B": table.best(n), "tokens_per_s": table[n].best_throughput,
                         "eager_tokens_per_s": table[n].throughput_of((1, 1))} for n in table.concurrencies}}
    return thresholds, dtmc


def real_pair(name: str) -> Pair:
    from aiorouter.cpu_threads import plan_threads
    from engines.config import ModelConfig
    small, large = pair_paths(name)
    vocab = ModelConfig.from_dir(large).vocab_size
    # the router's plan (the large model every core, the small one its share), per server process
    threads = dict(zip(("small", "large"), plan_threads([0, 1])))
    return Pair(name, "real", {"small": str(small), "large": str(large)}, min(vocab, W.VOCAB),
                http_models={"small": str(small), "large": str(large)}, std_threads=threads)


# -- workloads -----------------------------------------------------------------------------------------
# low-effort output tokens (full, quick); SmolLM2's steps are ~7x cpu-tiny's, so it writes half as many
DEFAULT_TOKENS = {"sim": (512, 32), "cpu-tiny": (128, 16), "smollm2": (64, 16)}


def workloads(pair: Pair, quick: bool, tokens: int | None = None) -> list[W.Workload]:
    """The paper's three workloads with output lengths scaled down (its 2,048 -> 8,192 step kept as
    `tokens` -> 4 x `tokens`; agentic writes `tokens` / 2, as 1,024 against 2,048). --quick: low-effort
    at both lengths on the sim, at `tokens` alone on a real pair."""
    V, L = pair.vocab, tokens or DEFAULT_TOKENS[pair.name][quick]
    short = W.short_prompts(0, 64, 100, 20, V)
    low = W.Workload("low-effort", short, L, f"~100-token prompts, {L} output tokens")
    if quick:
        return [low, W.Workload("low-effort", short, 4 * L, f"~100-token prompts, {4 * L} output tokens")] \
            if pair.engine == "sim" else [low]
    high = W.Workload("high-effort", W.short_prompts(1, 64, 100, 20, V), 4 * L, f"~100-token prompts, {4 * L} output tokens")
    if pair.engine == "sim":  # prompts at the paper's size: a sim prefill costs a step per 2,048-token chunk
        agentic = W.Workload("agentic", W.agentic_prompts(2, sessions=8, turns=5, preamble=2048, first_turn=4608,
                                                          answer=512, user=256, vocab=V), max(1, L // 2),
                             "~8,192-token multi-turn prompts (8 sessions x 5 turns, 2,048-token shared preamble), "
                             f"{max(1, L // 2)} output tokens")
    else:
        agentic = W.Workload("agentic", W.agentic_prompts(2, vocab=V), max(1, L // 2),
                             f"~2,048-token multi-turn prompts (8 sessions x 5 turns), {max(1, L // 2)} output tokens")
    return [low, high, agentic]


def requests_per_client(wl: W.Workload, wls: list[W.Workload], least: int) -> int:
    """On the ~100-token prompts every client writes as many tokens at each output length (4 requests
    of L, 1 of 4L): a closed loop ends with its slowest client, and a request's routing draws spread
    its time by ~1/sqrt(tokens), so equal tokens per client give both lengths the same tail and the
    throughput change is the length's own: on the sim at N = 4, one request of 32 tokens against one
    of 128 read 20 % apart; 4 against 1, 3 %."""
    family = [w.max_tokens for w in wls if w.name in ("low-effort", "high-effort")]
    if wl.name not in ("low-effort", "high-effort"):
        return least
    return max(least, -(-max(family) // wl.max_tokens))


# -- one run per system -----------------------------------------------------------------------------------
async def _router_run(pair: Pair, system: str, wl: W.Workload, n: int, total: int) -> dict:
    from aiorouter import Router, RouterConfig
    if system == "large-alone":
        models, kw = {"large": pair.models["large"]}, dict(policy="single", mode="eager")
    else:
        mode = system.removeprefix("aiorouter-")
        models = pair.models
        kw = dict(policy=POLICY, policy_args=POLICY_ARGS, entry="small", mode=mode,
                  thresholds=pair.thresholds if mode == "delayed" else {"small": 1, "large": 1})
    async with Router(models, RouterConfig(kv_memory_gb=pair.kv_memory_gb, max_concurrency=max(n, 1), **kw)) as r:
        out = await router_loop(r, wl.prompts, n, total, wl.max_tokens, W.warmup_prompts(n, vocab=pair.vocab),
                                WARMUP_TOKENS)
        if system != "large-alone":
            out["thresholds"] = r.thresholds(n)
        return out


async def _std_run(pair: Pair, system: str, wl: W.Workload, n: int, total: int, http) -> dict:
    from bench.baselines import StdServing, TokenDispatcher, std_loop
    from policies import make_policy
    policy = make_policy(POLICY, POLICY_ARGS)
    args = (wl.prompts, n, total, wl.max_tokens, W.warmup_prompts(n, vocab=pair.vocab), WARMUP_TOKENS)
    if system == "std-serving-http":
        await http.reset()
        return await std_loop(TokenDispatcher(http.clients, policy), http.stats, *args)
    async with StdServing(pair.models, policy, pair.kv_memory_gb, STD_PAGE[pair.engine]) as std:
        return await std_loop(std.dispatcher, std.stats, *args)


async def run_one(pair: Pair, system: str, wl: W.Workload, n: int, total: int, http) -> dict:
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    pids = tuple(p.pid for p in http.procs) if (system == "std-serving-http" and http is not None) else ()
    try:
        with OutsideLoad(pids) as outside:
            if system.startswith("std-serving"):
                out = await _std_run(pair, system, wl, n, total, http)
            else:
                out = await _router_run(pair, system, wl, n, total)
        out["outside_cores"] = outside.cores  # CPU other processes used meanwhile: noise
    except Exception as e:  # one broken system must not sink the sweep
        import traceback
        traceback.print_exc()
        out = {"error": repr(e)}
    row = {"system": system, "engine": pair.engine, "pair": pair.name, "workload": wl.name, "N": n,
           "max_tokens": wl.max_tokens, "tokens_per_s": out.pop("tok_s", None),
           "per_user_tokens_per_s": out.pop("per_user_tok_s", None), "requests": total,
           "requests_per_client": total / n, **out,
           "wall_s": time.perf_counter() - t0, "load_avg": [load0, os.getloadavg()]}
    if pair.engine == "sim" and system == "aiorouter-delayed":
        row["dtmc_tokens_per_s"] = pair.notes["dtmc"]["by_N"][n]["tokens_per_s"]
        # no system beats this: every token takes a small step and, with probability p, a large
        # one after it, each at least L(1); N requests at that pace with no wait at all
        row["ceiling_tokens_per_s"] = n * 1000 / (SIM_MS["small"] + POLICY_ARGS["p"] * SIM_MS["large"])
    gc.collect()
    return row


# -- the sweep ------------------------------------------------------------------------------------------
def key(row: dict) -> tuple:
    return tuple(row[k] for k in KEY)


def save(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=1, default=str))  # a crash mid-write leaves the last complete file


async def sweep(args, pairs: list[Pair], plan: list[tuple], data: dict, path: Path) -> None:
    from tqdm import tqdm

    from bench.baselines import ServerProcesses, ServerSpec
    done = {key(r) for r in data["runs"] if not r.get("error")}
    todo = [p for p in plan if (p[0].engine, p[0].name, p[1].name, p[1].max_tokens, p[2], p[3]) not in done]
    if len(todo) < len(plan):
        print(f"resuming: {len(plan) - len(todo)} of {len(plan)} runs are in {path}", flush=True)
    with tqdm(total=len(plan), initial=len(plan) - len(todo), desc="paper regime", unit="run") as bar:
        for pair in pairs:
            mine = [p for p in todo if p[0] is pair]
            if not mine:
                continue
            async with contextlib.AsyncExitStack() as stack:
                http = None  # one server process per model for the pair's block, flushed between runs
                if any(p[3] == "std-serving-http" for p in mine):
                    bar.set_postfix_str(f"{pair.name}: starting the token servers")
                    specs = [ServerSpec(k, pair.http_models[k], pair.std_threads[k], STD_PAGE[pair.engine],
                                        num_kv_tokens=(1 << 19) if pair.engine == "sim" else None,
                                        kv_memory_gb=pair.kv_memory_gb / 2,
                                        max_model_len=16384 if pair.engine == "sim" else None, vocab_size=SIM_VOCAB)
                             for k in ("small", "large")]
                    http = await stack.enter_async_context(ServerProcesses(specs))
                for p, wl, n, system, total in mine:
                    bar.set_postfix_str(f"{pair.name} {wl.name}@{wl.max_tokens} N={n} {system}")
                    row = await run_one(p, system, wl, n, total, http)
                    data["runs"] = [r for r in data["runs"] if key(r) != key(row)] + [row]
                    save(path, data)
                    bar.update(1)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.paper_regime", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="sim N = 1, 4, 16 at two lengths 4x apart, cpu-tiny N = 4")
    ap.add_argument("--out", default=None, help="output folder (default bench/results)")
    ap.add_argument("--md", default=None, help="tables file (default DIR/paper_regime.md)")
    ap.add_argument("--pairs", default=None, help=f"comma list of {', '.join(PAIRS)} (quick: sim,cpu-tiny)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--workloads", default=",".join(W.WORKLOADS), help="comma list of low-effort, high-effort, agentic")
    ap.add_argument("--concurrency", default=None, help="comma list of N (default 1,4,8,16; quick: 1,4,16 sim, 4 real)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="low-effort output length; high-effort writes 4x, agentic 1/2 (default: sim 512, cpu-tiny 128, "
                         "smollm2 64; quick: sim 32 and 128, real 16)")
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--min-requests", type=int, default=None, help="at least this many requests per run (default 2; quick 1)")
    ap.add_argument("--sim-slope-ms", default="0,0", metavar="SMALL,LARGE",
                    help="sim step slope per sequence in the batch (ms); L(1) stays 6.0 / 27.9 (default 0,0)")
    ap.add_argument("--std-threads", default=None, metavar="SMALL,LARGE",
                    help="intra-op threads of the real pairs' token server processes (default: the router's plan)")
    ap.add_argument("--report-only", action="store_true", help="rewrite the tables from DIR/paper_regime.json, run nothing")
    ap.add_argument("--resume", action="store_true", help="keep the runs already in DIR/paper_regime.json, run the rest")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from aiorouter import run
    quick = args.quick
    out_dir = Path(args.out) if args.out else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "paper_regime.json"
    md = Path(args.md) if args.md else path.with_suffix(".md")
    if args.report_only:
        data = json.loads(path.read_text())
        data.update(analyse(data["runs"]))
        save(path, data)
        write_tables(data, md, path)
        print(summary(data))
        return 0
    pair_names = commas(args.pairs or ("sim,cpu-tiny" if quick else ",".join(PAIRS)), allowed=PAIRS)
    systems = commas(args.systems, allowed=SYSTEMS)
    wl_names = commas(args.workloads, allowed=W.WORKLOADS)
    args.min_requests = args.min_requests or (1 if quick else 2)
    slope = tuple(commas(args.sim_slope_ms, float))
    if len(slope) != 2 or any(c < 0 or c >= ms for c, ms in zip(slope, SIM_MS.values())):
        raise SystemExit(f"--sim-slope-ms takes SMALL,LARGE in [0, step), got {args.sim_slope_ms!r}")
    load = os.getloadavg()
    print(f"paper regime: pairs {pair_names}, systems {systems}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
          flush=True)
    t0 = time.perf_counter()
    def concurrency(engine: str) -> list[int]:
        if args.concurrency:
            return commas(args.concurrency, int)
        return ([1, 4, 16] if engine == "sim" else [4]) if quick else [1, 4, 8, 16]

    pairs = [sim_pair(slope, max(concurrency("sim"))) if p == "sim" else real_pair(p) for p in pair_names]
    if args.std_threads:
        threads = dict(zip(("small", "large"), commas(args.std_threads, int)))
        for p in pairs:
            if p.engine == "real":
                p.std_threads = threads
    plan = []
    for pair in pairs:
        ns = concurrency(pair.engine)
        wls = workloads(pair, quick, args.tokens)
        for wl in wls:
            if wl.name not in wl_names:
                continue
            rpc = requests_per_client(wl, wls, args.requests_per_client)
            for n in ns:
                total = max(n * rpc, args.min_requests)
                plan += [(pair, wl, n, s, total) for s in systems]  # systems innermost: drift hits them alike
    prev = json.loads(path.read_text()) if args.resume and path.is_file() else {}
    data = {"machine": {**machine(), "load_avg_start": load}, "partial": True, "runs": prev.get("runs", []),
            "config": {"quick": quick, "policy": {POLICY: POLICY_ARGS}, "sim_step_ms": SIM_MS,
                       "sim_slope_ms": dict(zip(SIM_MS, slope)), "std_page_size": STD_PAGE,
                       "requests_per_client": args.requests_per_client, "min_requests": args.min_requests,
                       "warmup_tokens": WARMUP_TOKENS, "temperature": 0.0, "ignore_eos": True},
            "pairs": {**prev.get("pairs", {}), **{p.name: {"engine": p.engine, "models": p.models,
                                                           "std_threads": p.std_threads, **p.notes} for p in pairs}},
            "workloads": {**prev.get("workloads", {}), **{f"{p.name}/{w.name}@{w.max_tokens}": w.describe()
                                                          for p in pairs for w in workloads(p, quick, args.tokens)}}}
    if prev:
        data["resumed_from"] = prev.get("machine", {})
    run(sweep(args, pairs, plan, data, path))
    data["partial"] = False
    data["machine"]["load_avg_end"] = os.getloadavg()
    data["duration_s"] = time.perf_counter() - t0
    data.update(analyse(data["runs"]))
    save(path, data)
    write_tables(data, md, path)
    print(summary(data))
    print(f"wrote {path} and {md} in {data['duration_s']:.0f} s", flush=True)
    return 0


# -- targets, the paper's figures beside ours, and the tables ------------------------------------------
SHORT = {"aiorouter-delayed": "delayed", "aiorouter-eager": "eager", "aiorouter-sync": "sync",
         "std-serving-http": "Std HTTP", "std-serving-inproc": "Std in-proc", "large-alone": "large alone"}
# The paper's figures (section 5.2): over the stronger baseline, 15 algorithm-workload pairs; Std. Serving's
# loss from 2,048 to 8,192 output tokens; R2R from N = 1 to 16.
PAPER = {"gain": (2.01, 64.15), "std_loss_pct": (58.1, 85.2), "n16_over_n1": 8.61, "per_user_kept_pct": 51.7}


def _ok(r: dict | None) -> bool:
    return r is not None and not r.get("error") and bool(r.get("tokens_per_s"))


def index(runs: list[dict]) -> dict:
    return {(r["engine"], r["pair"], r["workload"], r["max_tokens"], r["N"], r["system"]): r for r in runs if _ok(r)}


def _lengths(ix: dict, engine: str, pair: str, workload: str) -> list[int]:
    return sorted({k[3] for k in ix if k[:3] == (engine, pair, workload)})


def length_pairs(ix: dict) -> list[dict]:
    """Runs 4x apart in output length on ~100-token prompts: low-effort at L against low-effort or
    high-effort (the same prompt family, as in the paper) at 4L."""
    rows = []
    for (engine, pair, wl, L, n, system), base in ix.items():
        if wl != "low-effort":
            continue
        for long_wl in ("low-effort", "high-effort"):
            long = ix.get((engine, pair, long_wl, 4 * L, n, system))
            if long is not None:
                rows.append({"engine": engine, "pair": pair, "system": system, "N": n, "short": f"{wl}@{L}",
                             "long": f"{long_wl}@{4 * L}", "change_pct": 100 * (long["tokens_per_s"] / base["tokens_per_s"] - 1)})
    return sorted(rows, key=lambda r: (r["engine"], r["pair"], r["system"], r["N"]))


def _ratio(ix, a, b) -> float | None:
    ra, rb = ix.get(a), ix.get(b)
    return ra["tokens_per_s"] / rb["tokens_per_s"] if ra and rb else None


def _target(name: str, value: float | None, target: float, above: bool = True, note: str = "") -> dict:
    met = None if value is None else (value >= target if above else value <= target)
    return {"name": name, "value": value, "target": target, "met": met, "note": note}


def analyse(runs: list[dict]) -> dict:
    ix = index(runs)
    targets = []
    lows = _lengths(ix, "sim", "sim", "low-effort")
    L = lows[0] if lows else None
    if L is not None:
        k = lambda n, s: ("sim", "sim", "low-effort", L, n, s)
        d4, s4 = ix.get(k(4, "aiorouter-delayed")), ix.get(k(4, "std-serving-http"))
        bound = ""
        if d4 and s4 and d4.get("ceiling_tokens_per_s"):
            bound = (f"bound: the throughput model's optimum {d4['dtmc_tokens_per_s']:.0f} tok/s = "
                     f"{d4['dtmc_tokens_per_s'] / s4['tokens_per_s']:.2f}x; any system, no waits, "
                     f"{d4['ceiling_tokens_per_s']:.0f} tok/s = {d4['ceiling_tokens_per_s'] / s4['tokens_per_s']:.2f}x")
        targets.append(_target(f"sim low-effort@{L}: delayed / Std HTTP, N=4", _ratio(ix, k(4, "aiorouter-delayed"),
                                                                                    k(4, "std-serving-http")), 3.0,
                               note=bound))
        targets.append(_target(f"sim low-effort@{L}: delayed N=16 / N=1", _ratio(ix, k(16, "aiorouter-delayed"),
                                                                               k(1, "aiorouter-delayed")), 8.0))
        u1, u16 = ix.get(k(1, "aiorouter-delayed")), ix.get(k(16, "aiorouter-delayed"))
        kept = u16["per_user_tokens_per_s"] / u1["per_user_tokens_per_s"] if u1 and u16 else None
        targets.append(_target(f"sim low-effort@{L}: delayed per-user speed N=16 / N=1", kept, 0.5))
    lp = length_pairs(ix)
    for row in lp:
        if row["engine"] == "sim" and row["system"] == "aiorouter-delayed":
            targets.append(_target(f"sim {row['short']} -> {row['long']}: delayed throughput change, N={row['N']} (%)",
                                   abs(row["change_pct"]), 10.0, above=False, note=f"{row['change_pct']:+.1f} %"))
    for L in _lengths(ix, "real", "cpu-tiny", "low-effort")[:1]:
        k = lambda s: ("real", "cpu-tiny", "low-effort", L, 4, s)
        inproc = _ratio(ix, k("aiorouter-delayed"), k("std-serving-inproc"))
        targets.append(_target(f"cpu-tiny low-effort@{L}: delayed / Std HTTP, N=4",
                               _ratio(ix, k("aiorouter-delayed"), k("std-serving-http")), 3.0,
                               note=f"in-process Std: {inproc:.2f}x" if inproc else ""))
    return {"targets": targets, "length_scaling": lp, "paper_side_by_side": side_by_side(ix, lp)}


def side_by_side(ix: dict, lp: list[dict]) -> list[dict]:
    def span(xs):
        xs = [x for x in xs if x is not None]
        return (min(xs), max(xs)) if xs else None

    rows = []
    for engine, pair in sorted({(k[0], k[1]) for k in ix}):
        gains = {k[4]: [] for k in ix}
        for k in ix:
            if k[:2] == (engine, pair) and k[5] == "aiorouter-delayed":
                gains[k[4]].append(_ratio(ix, k, k[:5] + ("std-serving-http",)))
        loss = [-r["change_pct"] for r in lp if (r["engine"], r["pair"], r["system"]) == (engine, pair, "std-serving-http")]
        ours = [r["change_pct"] for r in lp if (r["engine"], r["pair"], r["system"]) == (engine, pair, "aiorouter-delayed")]
        scale, kept = [], []
        for k in ix:
            if k[:2] == (engine, pair) and k[4] == 1 and k[5] == "aiorouter-delayed":
                r1, r16 = ix[k], ix.get(k[:4] + (16, k[5]))
                if r16:
                    scale.append(r16["tokens_per_s"] / r1["tokens_per_s"])
                    kept.append(100 * r16["per_user_tokens_per_s"] / r1["per_user_tokens_per_s"])
        rows.append({"engine": engine, "pair": pair, "gain_over_std_http_n4": span(gains.get(4, [])),
                     "gain_over_std_http": span([g for gs in gains.values() for g in gs]), "std_http_loss_pct": span(loss),
                     "aiorouter_change_pct": span(ours), "n16_over_n1": span(scale), "per_user_kept_pct": span(kept)})
    return rows


# -- markdown ---------------------------------------------------------------------------------------------
def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _span(s, fmt="{:.2f}", unit="") -> str:
    if s is None:
        return "-"
    return f"{fmt.format(s[0])}{unit}" if abs(s[1] - s[0]) < 1e-9 else f"{fmt.format(s[0])} to {fmt.format(s[1])}{unit}"


def tables(data: dict) -> str:
    ix = index(data["runs"])
    m, prev = data["machine"], data.get("resumed_from")
    # a resumed sweep holds runs of two sessions (or more: resumed_from is the last one's machine)
    runs_s = sum(r.get("wall_s", 0.0) for r in data["runs"])
    kind = f"{'quick' if data['config']['quick'] else 'full'} run" + (", partial" if data.get("partial") else "")
    took = f"{data['duration_s'] / 60:.1f} min" if data.get("duration_s") else f"{runs_s / 60:.1f} min of runs"
    out = [f"Machine: {m.get('cpu')}, {m.get('cores')} cores, torch {m.get('torch')}; commit `{str(m.get('commit'))[:10]}`"
           + (f" (resuming runs made on `{str(prev.get('commit'))[:10]}`, load average {_load(prev.get('load_avg_start'))} "
              f"at start, {_load(prev.get('load_avg_end'))} at end)" if prev else "")
           + f"; {kind} of {len(data['runs'])} runs in {took}; load average {_load(m.get('load_avg_start'))} at start, "
           f"{_load(m.get('load_avg_end'))} at end. Policy random p = 0.35 everywhere; sim steps "
           f"{data['config']['sim_step_ms']} ms, slope {data['config']['sim_slope_ms']} ms per sequence.", ""]
    out += ["### Targets", "", "| target | measured | goal | met? | note |", "|---|---:|---:|---|---|"]
    for t in data["targets"]:
        goal = f"{'>=' if 'change' not in t['name'] else '<='} {t['target']:g}"
        out.append(f"| {t['name']} | {_f(t['value'])} | {goal} | {'-' if t['met'] is None else 'yes' if t['met'] else '**no**'} "
                   f"| {t['note']} |")
    out += ["", "### Side by side with the paper", "",
            "| figure | paper (A100s, SGLang, Qwen3-0.6B/32B) | " + " | ".join(f"{r['pair']} ({r['engine']})" for r in data["paper_side_by_side"]) + " |",
            "|---|---|" + "---|" * len(data["paper_side_by_side"])]
    sbs = data["paper_side_by_side"]
    out.append("| throughput over Std. Serving (paper: 15 algorithm-workload pairs; here: random p = 0.35, "
               f"every workload) | {PAPER['gain'][0]}-{PAPER['gain'][1]}x over the stronger baseline | " +
               " | ".join(f"N=4: {_span(r['gain_over_std_http_n4'], unit='x')}; all N: {_span(r['gain_over_std_http'], unit='x')}"
                          for r in sbs) + " |")
    out.append(f"| Std. Serving's loss when outputs grow 4x | {PAPER['std_loss_pct'][0]}-{PAPER['std_loss_pct'][1]} % | " +
               " | ".join(_span(r["std_http_loss_pct"], "{:.1f}", " %") for r in sbs) + " |")
    out.append("| aiorouter's change when outputs grow 4x | holds steady | " +
               " | ".join(_span(r["aiorouter_change_pct"], "{:+.1f}", " %") for r in sbs) + " |")
    out.append(f"| throughput N=16 / N=1 | {PAPER['n16_over_n1']}x | " + " | ".join(_span(r["n16_over_n1"], unit="x") for r in sbs) + " |")
    out.append(f"| per-user speed kept at N=16 | {PAPER['per_user_kept_pct']} % | " + " | ".join(_span(r["per_user_kept_pct"], "{:.1f}", " %") for r in sbs) + " |")
    out += ["", "### Throughput, tokens/s (per-user tokens/s)", ""]
    systems = [s for s in SHORT if any(k[5] == s for k in ix)]
    for engine, pair, wl, L in sorted({k[:4] for k in ix}, key=lambda k: (k[0] != "sim", k[1], k[2], k[3])):
        desc = data.get("workloads", {}).get(f"{pair}/{wl}@{L}", {}).get("description", "")
        out += [f"**{pair} ({engine}), {wl}, {L} output tokens**" + (f" -- {desc}" if desc else ""), "",
                "| N | " + " | ".join(SHORT[s] for s in systems) + " | delayed / Std HTTP | delayed / Std in-proc |"
                + (" DTMC bound (delayed) |" if engine == "sim" else ""),
                "|---:|" + "---:|" * (len(systems) + 2) + ("---:|" if engine == "sim" else "")]
        for n in sorted({k[4] for k in ix if k[:4] == (engine, pair, wl, L)}):
            cells = []
            for s in systems:
                r = ix.get((engine, pair, wl, L, n, s))
                cells.append(f"{r['tokens_per_s']:.1f} ({r['per_user_tokens_per_s']:.1f})" if r else "-")
            k = lambda s: (engine, pair, wl, L, n, s)
            row = f"| {n} | " + " | ".join(cells) + f" | {_f(_ratio(ix, k('aiorouter-delayed'), k('std-serving-http')), '{:.2f}x')} " \
                  f"| {_f(_ratio(ix, k('aiorouter-delayed'), k('std-serving-inproc')), '{:.2f}x')} |"
            if engine == "sim":
                d = ix.get(k("aiorouter-delayed"), {}).get("dtmc_tokens_per_s")
                row += f" {_f(d, '{:.1f}')} |"
            out.append(row)
        out.append("")
    out += ["### Where a Std. Serving token's time goes (the paper's Table 10)", "",
            "Per token (= per request: each returns one) in ms, std-serving-http unless noted. *round trip*: the "
            "dispatcher's await of the server; *HTTP outside*: round trip minus the server's handler (client, "
            "loopback, aiohttp framing); *handling*: the handler minus the engine server (decode ids, encode reply); "
            "*queue*: waiting for the step in flight; *step*: the step the request rides in (*wake-up*: from its end to "
            "the reply), split per step into "
            "*admission + prefix match* (`Engine.add` + `Engine.schedule`), *forward* (a sim step's sleep), "
            "*KV update* (`Engine.finish` + `release`: pages written, full ones into the prefix cache); *policy*: "
            "route/send/receive in the dispatcher.", "",
            "| run | model | batch | round trip | HTTP outside | handling | queue | step | wake-up | admission + prefix match | forward | KV update | policy |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, r in sorted(ix.items(), key=lambda kv: (kv[0][0] != "sim", kv[0][1:5])):
        if k[5] not in ("std-serving-http", "std-serving-inproc") or "breakdown" not in r:
            continue
        if k[4] not in ((4,) if k[5] == "std-serving-inproc" else (4, 16)):
            continue  # N = 4 and 16 over HTTP, N = 4 in process (every run's split is in the JSON)
        for model, b in r["breakdown"].items():
            t, st = b["per_token_ms"], b["per_step_ms"]
            label = f"{k[1]} {k[2]}@{k[3]} N={k[4]}" + (" (in-proc)" if k[5] == "std-serving-inproc" else "")
            out.append(f"| {label} | {model} | {b['mean_batch']:.2f} | {t['round_trip']:.2f} | {t['http_outside_server']:.2f} "
                       f"| {t['server_http_handling']:.2f} | {t['queue']:.2f} | {t['step']:.2f} | {t['reply_wakeup']:.2f} | {st['admit_prefix_match']:.3f} "
                       f"| {st['forward']:.2f} | {st['kv_update']:.3f} | {t['policy']:.3f} |")
    return "\n".join(out) + "\n"


def _load(x) -> str:
    return "/".join(f"{v:.2f}" for v in x) if x else "?"


def write_tables(data: dict, md: Path, json_path: Path) -> None:
    md.write_text(f"# The paper's regime: every table\n\n_Generated by `python -m bench.paper_regime`; raw data: "
                  f"`{rel(json_path)}`; the claims and how to read them: bench/RESULTS.md._\n\n{tables(data)}")


def summary(data: dict) -> str:
    lines = ["targets:"]
    for t in data["targets"]:
        lines.append(f"  {t['name']}: {_f(t['value'])} (goal {'<=' if 'change' in t['name'] else '>='} {t['target']:g}) "
                     f"{'-' if t['met'] is None else 'met' if t['met'] else 'MISSED'} {t['note']}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
