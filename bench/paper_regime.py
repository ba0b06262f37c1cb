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
server process per model, bench/token_server.py, and a per-token dispatcher here),
std-serving-inproc (the same servers and dispatcher in this process), large-alone.

Writes DIR/paper_regime.json ({"runs": [...]}, one object per run) after every run, and the
tables (bench/paper_report.py) into bench/RESULTS.md (--quick: DIR/RESULTS-paper-regime-quick.md).
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
from bench.common import ROOT, OutsideLoad, closed_loop, machine, tiny_qwen3

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
    if name == "cpu-tiny":
        small, large = tiny_qwen3("small"), tiny_qwen3("large")
    elif name == "smollm2":
        from engines.default_model import truncated_model_path
        from engines.known_models import default_model_path
        large = default_model_path()
        small = truncated_model_path(large, 10)
    else:
        raise ValueError(f"unknown pair {name!r}; choose from {', '.join(PAIRS)}")
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
        async def send(p, max_tokens=wl.max_tokens):
            async for ev in r.stream(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                yield ev.model

        await r.wait_tuned()
        await closed_loop(lambda p: send(p, min(WARMUP_TOKENS, wl.max_tokens)), n, W.warmup_prompts(n, vocab=pair.vocab), n)
        for m in r.metrics.models.values():  # measure the run only
            m.steps, m.step_time_sum, m.admission_delay_sum, m.admission_delay_count = 0, 0.0, 0.0, 0
            m.batch_sizes.clear()
        res = await closed_loop(send, n, wl.prompts, total)
        out = res.summary()
        if system != "large-alone":
            out["thresholds"] = r.thresholds(n)
        out["mean_batch"] = {k: m.mean_batch_size for k, m in r.metrics.models.items()}
        out["step_ms"] = {k: 1000 * m.step_time_sum / max(1, m.steps) for k, m in r.metrics.models.items()}
        out["admission_delay_ms"] = {k: 1000 * m.mean_admission_delay for k, m in r.metrics.models.items()}
        return out


async def _std_run(pair: Pair, system: str, wl: W.Workload, n: int, total: int, http) -> dict:
    from aiorouter import heap
    from bench.std_serving import StdServing, TokenDispatcher, server_delta
    from policies import make_policy
    policy = make_policy(POLICY, POLICY_ARGS)
    async with contextlib.AsyncExitStack() as stack:
        if system == "std-serving-http":
            await http.reset()
            disp, stats = TokenDispatcher(http.clients, policy), http.stats
        else:
            std = await stack.enter_async_context(StdServing(pair.models, policy, pair.kv_memory_gb, STD_PAGE[pair.engine]))
            disp = std.dispatcher

            async def stats():  # no HTTP in process: nothing is handled outside the engine server
                return {k: {**v, "handler_s": 0.0} for k, v in std.stats().items()}

        async def send(p, max_tokens=wl.max_tokens):
            async for _, model in disp.stream(p, max_tokens):
                yield model

        await closed_loop(lambda p: send(p, min(WARMUP_TOKENS, wl.max_tokens)), n, W.warmup_prompts(n, vocab=pair.vocab), n)
        before, t0 = await stats(), _snapshot(disp.times)
        with heap.frozen():  # what Router.start does, for the baselines that have no Router
            res = await closed_loop(send, n, wl.prompts, total)
        after, t1 = await stats(), _snapshot(disp.times)
    out = res.summary()
    servers = {k: server_delta(before[k], after[k]) for k in after}
    out["servers"] = servers
    out["mean_batch"] = {k: v["mean_batch"] for k, v in servers.items()}
    out["breakdown"] = breakdown(servers, {k: t1[k] - t0[k] for k in t0}, disp.names)
    return out


def _snapshot(t) -> dict[str, float]:
    snap = {f"calls:{k}": v for k, v in t.calls.items()}
    snap.update({f"wait_s:{k}": v for k, v in t.wait_s.items()})
    snap["policy_s"] = t.policy_s
    return snap


def breakdown(servers: dict, disp: dict, names: list[str]) -> dict:
    """Table 10's split of a Std. Serving token, per model, in ms (per token = per request: each
    returns one). The round trip (the dispatcher's await) = HTTP outside the server's handler
    (client, loopback, framing) + the handler's own work (decode ids, encode the reply) + the queue
    (waiting for the step in flight) + the step it rides in + the loop's wake-up to reply. The step
    splits per step into admission and prefix matching, the forward, and the KV update."""
    out = {}
    calls_all = sum(disp[f"calls:{k}"] for k in names) or 1
    for k in names:
        s, calls, reqs = servers[k], max(1, disp[f"calls:{k}"]), max(1, servers[k]["requests"])
        step, req = s["per_step_ms"], s["per_request_ms"]
        rtt, handler = 1000 * disp[f"wait_s:{k}"] / calls, 1000 * s["handler_s"] / reqs  # handler: 0 in process
        step_ms = step["admit"] + step["forward"] + step["kv"]
        out[k] = {"requests": s["requests"], "steps": s["steps"], "mean_batch": s["mean_batch"],
                  "per_step_ms": {"admit_prefix_match": step["admit"], "forward": step["forward"], "kv_update": step["kv"]},
                  "per_token_ms": {"round_trip": rtt, "http_outside_server": rtt - handler if handler else 0.0,
                                   "server_http_handling": handler - req["served"] if handler else 0.0,
                                   "queue": req["queue"], "step": step_ms, "reply_wakeup": req["served"] - req["queue"] - step_ms,
                                   "policy": 1000 * disp["policy_s"] / calls_all}}
    return out


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
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)  # a crash mid-write leaves the last complete file


async def sweep(args, pairs: list[Pair], plan: list[tuple], data: dict, path: Path) -> None:
    from tqdm import tqdm

    from bench.token_server import ServerProcesses, ServerSpec
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
    ap.add_argument("--md", default=None, help="tables file (default bench/RESULTS.md; --quick: DIR/RESULTS-paper-regime-quick.md)")
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
    from bench import paper_report
    quick = args.quick
    out_dir = Path(args.out) if args.out else ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    md = Path(args.md) if args.md else (out_dir / "RESULTS-paper-regime-quick.md" if quick else ROOT / "bench" / "RESULTS.md")
    path = out_dir / "paper_regime.json"
    if args.report_only:
        data = json.loads(path.read_text())
        data.update(paper_report.analyse(data["runs"]))
        save(path, data)
        paper_report.write(data, md, path)
        print(paper_report.summary(data))
        return 0
    pair_names = [x for x in (args.pairs or ("sim,cpu-tiny" if quick else ",".join(PAIRS))).split(",") if x]
    systems = [x for x in args.systems.split(",") if x]
    wl_names = [x for x in args.workloads.split(",") if x]
    for bad in [x for x in pair_names if x not in PAIRS] + [x for x in systems if x not in SYSTEMS] + \
            [x for x in wl_names if x not in W.WORKLOADS]:
        raise SystemExit(f"unknown pair, system or workload {bad!r}; pairs: {', '.join(PAIRS)}; systems: "
                         f"{', '.join(SYSTEMS)}; workloads: {', '.join(W.WORKLOADS)}")
    args.min_requests = args.min_requests or (1 if quick else 2)
    slope = tuple(float(x) for x in args.sim_slope_ms.split(","))
    if len(slope) != 2 or any(c < 0 or c >= ms for c, ms in zip(slope, SIM_MS.values())):
        raise SystemExit(f"--sim-slope-ms takes SMALL,LARGE in [0, step), got {args.sim_slope_ms!r}")
    load = os.getloadavg()
    print(f"paper regime: pairs {pair_names}, systems {systems}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
          flush=True)
    t0 = time.perf_counter()
    def concurrency(engine: str) -> list[int]:
        if args.concurrency:
            return [int(x) for x in args.concurrency.split(",")]
        return ([1, 4, 16] if engine == "sim" else [4]) if quick else [1, 4, 8, 16]

    pairs = [sim_pair(slope, max(concurrency("sim"))) if p == "sim" else real_pair(p) for p in pair_names]
    if args.std_threads:
        threads = dict(zip(("small", "large"), (int(x) for x in args.std_threads.split(","))))
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
    data.update(paper_report.analyse(data["runs"]))
    save(path, data)
    paper_report.write(data, md, path)
    print(paper_report.summary(data))
    print(f"wrote {path} and {md} in {data['duration_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
