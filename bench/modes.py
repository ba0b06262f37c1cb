"""The runtime's schedules side by side (`sync`, `eager`, `delayed`) on a real pair, each next to
what the throughput model predicts for it (bench/modes_model.py says from what).

    python -m bench.modes --pair cpu-tiny|smollm2 [--concurrency 1,4,8,16] [--tokens 64]
                          [--requests-per-client 2] [--min-requests 8] [--rounds 1] [--sweep [--sweep-at 4,8]]
                          [--delayed-thresholds model|auto] [--no-stagger]
                          [--quiet-gate CORES] [--out DIR]
    python -m bench.modes --pair ... --interleave [--rounds 4] [--window 5] [--settle 1] [--window-lives 2] [--window-requests 8] [--settle-lives 0.5] [--sweep [--sweep-rounds K] [--confirm K] [--race K]] [--race-modes K] [--keep-spans]

`--interleave` measures every schedule at N on one router under one unbroken closed loop, in
windows that take turns (bench/modes_interleaved.py says why: separate runs of one schedule
differed by 10-30 %; bench/modes_cycles.py runs them); without it, each schedule is separate
runs, as follows.

Per N, in one invocation: sync and eager run first (thresholds 1); the model then solves for the
routing they observed, and delayed runs the schedule it predicts best (`model`: delayed with B* forced
via Router(thresholds=...), or eager, or sync, whichever it predicts best; recorded as "schedule")
or the router's own start-up tuner's schedule at N (`auto`). `--sweep` also runs
delayed at every large-model threshold 1..N (small-model threshold as predicted; each point
`--rounds` times, its median kept), so the measured best threshold can be read against the
predicted one. Interleaved, a sweep point also pools delayed's windows where delayed ran its
schedule, and `--confirm K` measures the points near the measured top (and the predicted best)
K cycles more (`modes_cycles.contenders`), with sync, eager and delayed in each of those cycles too; the
measured best B is also read with each window against its cycle's sync and eager windows
(`blocked_best_B_measured`, bench.modes_interleaved.blocked). `--race K` then races the
predicted best point against the best other one in K pairs of fresh windows, which decide the
measured best B (`race_best_B_measured`; bench.modes_interleaved.race_read says why), and
`--race-modes K` races delayed against the better of sync and eager at every N
(`race_delayed`: the ratio and its standard error).

The chain describes a stationary closed loop: N requests in flight at spread phases. Clients that
start together with equal lengths stay in step instead (every prompt of a cohort prefilled at
once), so by default client k's first request has (k + 1) / N of the tokens, runs are that many
requests longer, and the chain is held to the window from the end of the last first request to
the drain (`closed_loop(first=...)`, `LoopResult.window`); the tokens each model computes per
request-step (tau) are counted in that window. Writes DIR/modes.json:
{"results": {"<mode>@<N>": {"tok_s", "predicted_tok_s", ...}}, "predictions": {N: ...},
"sweep": {N: {"<B>": {...}}}, "summary": {N: ...}}.

On a shared machine other processes' load moves a run's throughput by 3x (smollm2, N = 16:
27-100 tok/s at 0.02-1.6 other cores). `--quiet-gate C` waits (up to --quiet-patience) before
the profile and each run until other processes use less than C cores, and runs a measurement
once more when they used more while it ran, keeping the less disturbed; every run records
what they used.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import gzip
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from tqdm import tqdm

from aiorouter import Router
from bench import workloads as W
from bench.common import RESULTS, OutsideLoad, cache_dir, closed_loop, machine, rotated
from bench.modes_cycles import SWEEP_KEYS, WARMUP_TOKENS, interleaved_at, interleaved_policy_args, stagger
from bench.modes_interleaved import race_read, reset_window, window_steps
from bench.modes_model import delayed_choice, model_at, predicted_for, profile_pair
from bench.run import PAIRS, load_pair, tokens_computed


def wait_quiet(cores: float | None, window: float = 3.0, patience: float = 300.0) -> float | None:
    """Block until other processes use < `cores` over a `window` (at most `patience` s)."""
    if cores is None:
        return None
    deadline = time.monotonic() + patience
    while True:
        with OutsideLoad() as o:
            time.sleep(window)
        if o.cores is None or o.cores < cores or time.monotonic() > deadline:
            return o.cores


def gated(cores: float | None, run, patience: float, tries: int = 2) -> dict:
    """run() when quiet; again while other processes used >= `cores` during it. Keeps the run
    they disturbed least."""
    best = None
    for _ in range(tries if cores is not None else 1):
        wait_quiet(cores, patience=patience)
        out = run()
        load = out.get("outside_load_cores") or 0.0
        if best is None or load < (best.get("outside_load_cores") or 0.0):
            best = out
        if cores is None or load < cores:
            break
    return best


async def run_once(pair, mode: str, n: int, prompts: list, tokens: int, total: int,
                   thresholds: dict | str, staggered: bool = True) -> dict:
    models = {"small": str(pair.small), "large": str(pair.large)}
    async with Router(models, policy=pair.policy, policy_args=pair.policy_args, entry="small", mode=mode,
                      thresholds=thresholds, kv_memory_gb=1.0, max_concurrency=max(16, n)) as r:
        async def send(p, max_tokens=tokens):
            async for ev in r.stream(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                yield ev.model

        await r.wait_tuned()  # `auto`: measure the tuned thresholds, not the B = 1 stand-in
        await closed_loop(lambda p: send(p, WARMUP_TOKENS), n, W.warmup_prompts(n, vocab=pair.vocab), n)
        reset_window(r)  # measure the run only
        computed = tokens_computed(r)
        first = (lambda k, p: send(p, stagger(tokens, n, k))) if staggered and n > 1 else None
        with OutsideLoad() as outside:
            res = await closed_loop(send, n, prompts, total + (n if first else 0), first)
        out = res.summary()
        out["outside_load_cores"] = outside.cores  # other processes' CPU use during the run
        out["tokens_computed"] = {k: v - computed[k] for k, v in tokens_computed(r).items()}
        out["handoffs"] = {f"{a}->{b}": c for (a, b), c in r.metrics.handoffs.items()}
        out["request_steps"] = {k: sum(b * c for b, c in m.batch_sizes.items()) for k, m in r.metrics.models.items()}
        out["mean_batch"] = {k: m.mean_batch_size for k, m in r.metrics.models.items()}
        out["step_ms"] = {k: 1e3 * m.step_time_sum / max(1, m.steps) for k, m in r.metrics.models.items()}
        out["busy"] = {k: m.step_time_sum / res.seconds for k, m in r.metrics.models.items()}
        # the runtime's cost per step beyond the forward (event-loop work, thread hop), ms, and over how many steps
        out["overhead_ms"] = {k: {"loop": 1e3 * m.mean_overhead[0], "hop": 1e3 * m.mean_overhead[1],
                                  "steps": m.timed_steps} for k, m in r.metrics.models.items()}
        out["spans"] = {k: [tuple(x) for x in m.spans] for k, m in r.metrics.models.items()}
        # what the steady window computed, per model: the chain is compared with that window, so
        # its tokens per request-step come from it too (a window's share of prompt prefills is
        # not the whole run's: a run of 2 requests a client prefilled every prompt inside it)
        out["window_steps"] = {k: window_steps(v, res.window) for k, v in out["spans"].items()}
        if mode == "delayed":
            out["thresholds"] = r.thresholds(n)
            out["schedule"] = r.schedule(n)  # with thresholds="auto": the tuner's choice at N
        out["load_avg"] = os.getloadavg()
    gc.collect()
    return out


def summarise(n: int, results: dict, pred: dict, sweep: dict) -> dict:
    """Whole-run tok/s decides delayed against sync and eager (what a user gets); the chain, a
    steady-state model, is held to the steady window (`LoopResult.steady_tok_s`)."""
    runs = {m: results[f"{m}@{n}"] for m in ("sync", "eager", "delayed") if f"{m}@{n}" in results}
    t = {m: r["tok_s"] for m, r in runs.items()}
    steady = {m: r["steady_tok_s"] for m, r in runs.items()}
    out = {"measured": t, "steady": steady,
           "prediction_error": {m: runs[m]["predicted_tok_s"] / v - 1 for m, v in steady.items() if v},
           "startup_prediction_error": {m: runs[m]["startup_predicted_tok_s"] / v - 1 for m, v in steady.items() if v}}
    if "delayed" in t and ("sync" in t or "eager" in t):
        out["delayed_over_best_of_sync_eager"] = t["delayed"] / max(t.get("sync", 0), t.get("eager", 0))
        out["steady_delayed_over_best"] = steady["delayed"] / max(steady.get("sync", 0), steady.get("eager", 0))
        if "race" in runs["delayed"]:  # raced window by window against the better of sync and eager
            r = runs["delayed"]["race"]
            out["race_delayed"] = {"against": r["against"], **race_read(r["tok_s"], r["against_tok_s"]),
                                   # the chain picked the opponent's schedule: one schedule against itself
                                   "same_schedule": runs["delayed"].get("schedule") == r["against"]}
        rounds = [r.get("rounds_tok_s") for r in runs.values()]
        if all(rounds) and len({len(x) for x in rounds}) == 1:
            # round by round (the three modes of a round ran back to back, so a slow stretch of the
            # machine hits all three): the median of delayed / the better of that round's sync, eager
            best = [max(x) for x in zip(*(r["rounds_tok_s"] for m, r in runs.items() if m != "delayed"))]
            out["delayed_over_best_by_round"] = float(np.median([d / b for d, b in zip(runs["delayed"]["rounds_tok_s"], best)]))
    if sweep:
        out.update(sweep_read(pred["by_thresholds"], sweep, whole_run=True),
                   best_B_startup=",".join(map(str, pred["startup"]["best_thresholds"])))
    if "sync_eager_fit" in pred:  # the same, fitted on the sync and eager windows' forwards alone
        out["sync_eager_fit"] = {"prediction_error": {m: runs[m]["sync_eager_fit_predicted_tok_s"] / v - 1
                                                      for m, v in steady.items() if v}}
        if sweep:
            out["sync_eager_fit"].update(sweep_read(pred["sync_eager_fit"]["by_thresholds"], sweep))
    return out


def sweep_read(by_thresholds: dict[str, float], sweep: dict, whole_run: bool = False) -> dict:
    """A prediction read against the sweep: the chain's best among the thresholds swept (the small
    model's is the one delayed ran), the measured best and the loss there (on the steady window,
    with `whole_run` on whole runs too, and where the points carry it on `blocked_tok_s`, each
    window read against its cycle's sync and eager), and the error at every point."""
    b_pred = max(sweep, key=lambda b: by_thresholds[b])
    out = {"best_B_predicted": b_pred,
           "sweep_prediction_error": {b: by_thresholds[b] / v["steady_tok_s"] - 1 for b, v in sweep.items()}}
    reads = [("steady_tok_s", ""), ("tok_s", "whole_run_")][:2 if whole_run else 1]
    if all("blocked_tok_s" in v for v in sweep.values()):  # interleaved: each window against its cycle
        reads.append(("blocked_tok_s", "blocked_"))
    for key, tag in reads:
        best_meas = max(sweep, key=lambda b: sweep[b][key])
        out.update({f"{tag}best_B_measured": best_meas,
                    f"{tag}measured_loss_at_predicted_best": 1 - sweep[b_pred][key] / sweep[best_meas][key]})
    raced = [b for b, v in sweep.items() if "race_tok_s" in v]
    if len(raced) == 2 and b_pred in raced:  # the predicted best raced against the best other point
        other = raced[1] if raced[0] == b_pred else raced[0]
        r = race_read(sweep[b_pred]["race_tok_s"], sweep[other]["race_tok_s"])
        out.update(race_best_B_measured=b_pred if r["ratio"] >= 1 else other,
                   race_measured_loss_at_predicted_best=max(0.0, 1 - r["ratio"]), race={"against": other, **r})
    return out


def median_run(runs: list[dict], key: str) -> dict:
    return sorted(runs, key=lambda r: r[key])[len(runs) // 2]


def run_sweep(run, n: int, b0: int, rounds: int) -> dict:
    """Delayed at every feasible large-model threshold with the small one at b0, each `rounds`
    times, the points in turn (round r starts r points later), so drift over the sweep hits every
    point alike. A point's tok_s and steady_tok_s are the medians of its runs, the rest its median
    run's. One run a point read the cpu-tiny N = 16 sweep's best B 7.5 % above the predicted one
    on a single run whose neighbours were 5-9 % below it (bench/results/modes-final-cpu-tiny)."""
    points = [(b0, b1) for b1 in range(1, n - b0 + 2)]  # feasible: (b0 - 1) + (b1 - 1) < n
    runs: dict[tuple[int, int], list[dict]] = {b: [] for b in points}
    for rnd in range(rounds):
        for b in rotated(points, rnd):
            runs[b].append(run({"small": b[0], "large": b[1]}))
    out = {}
    for b, rs in runs.items():
        mid = median_run(rs, "steady_tok_s")
        out[f"{b[0]},{b[1]}"] = {**{k: mid[k] for k in SWEEP_KEYS},
                                 "tok_s": float(np.median([r["tok_s"] for r in rs])),
                                 "steady_tok_s": float(np.median([r["steady_tok_s"] for r in rs])),
                                 "rounds_tok_s": [r["tok_s"] for r in rs],
                                 "rounds_steady_tok_s": [r["steady_tok_s"] for r in rs]}
    return out


def gated_profile(pair, cap: int, gate: float | None, patience: float):
    """(profile, other processes' cores while it ran). Gated: measured afresh (not from the
    contention cache) until other processes stayed under the gate."""
    paths = {"small": pair.small, "large": pair.large}
    for _ in range(2):
        wait_quiet(gate, patience=patience)
        with OutsideLoad() as outside:
            prof = profile_pair(paths, cap, cache_dir() / "contention" if gate is None else None)
        if gate is None or (outside.cores or 0.0) < gate:
            break
    return prof, outside.cores


def separate_at(run, n: int, args, modes: list[str], prof, tpl_P, tpl_C, sweep_here: bool) -> tuple[dict, dict, dict]:
    """Every schedule at N as separate runs, each its own router and closed loop: sync and eager
    first; the model fitted on them names what delayed runs; `--rounds` rounds in rotating
    order, each mode's figure its median run. -> (results at N, prediction, sweep)."""
    results = {}
    total = max(n * args.requests_per_client, args.min_requests)
    ones = {"small": 1, "large": 1}
    for mode in [m for m in ("sync", "eager") if m in modes]:
        results[f"{mode}@{n}"] = run(mode, n, total, ones)
    seen = [results[f"{m}@{n}"] for m in ("sync", "eager") if f"{m}@{n}" in results]
    pred = model_at(prof, seen, tpl_P, tpl_C, n)
    if "delayed" in modes:
        if args.delayed_thresholds == "model":
            # delayed batching is the best schedule the model finds: delayed(B*), eager or sync
            sched, th = delayed_choice(pred, prof.names)
            delayed = lambda: run("sync" if sched == "sync" else "delayed", n, total, th)  # noqa: E731
        else:
            sched, delayed = None, lambda: run("delayed", n, total, "auto")  # noqa: E731
        results[f"delayed@{n}"] = delayed()
        if sched is not None:
            results[f"delayed@{n}"]["schedule"] = sched
        # more rounds, the three in turn, each round starting one mode later (round 1 ran sync,
        # eager, delayed; round 2 runs eager, delayed, sync; ...): at N = 1 the three run one
        # schedule, and a fixed order read delayed 0.91x eager from run order alone (delayed
        # first: 56.9 / 52.9 / 57.0 / 63.1 against eager's 54.2 / 56.9 / 54.1 / 55.9 tok/s).
        # Each mode's figure is its median run.
        more = {m: [results[f"{m}@{n}"]] for m in ("sync", "eager", "delayed") if f"{m}@{n}" in results}
        order = list(more)
        for rnd in range(1, args.rounds):
            for m in rotated(order, rnd):
                more[m].append(delayed() if m == "delayed" else run(m, n, total, ones))
        if args.rounds > 1 and seen:
            # The figures are predicted again from every round's sync and eager runs (never a
            # delayed run): this machine's speed moves by ~7 % over seconds (a 2-core matmul's
            # medians 1.34-1.54 s in eight 5 s windows), and a fit on one round's runs carries
            # that round's speed into every prediction at N. Delayed ran the first fit's choice.
            first = pred
            pred = model_at(prof, [r for m in ("sync", "eager") if m in more for r in more[m]], tpl_P, tpl_C, n)
            pred["first_round"] = {k: first[k] for k in ("schedule", "best_thresholds", "best_tok_s",
                                                         "eager_tok_s", "sync_tok_s", "by_thresholds")}
        if args.rounds > 1:
            for m, runs in more.items():
                mid = median_run(runs, "tok_s")
                for r in runs:
                    r.pop("spans", None)
                # (the chain is held to the median window, as each sweep point's is)
                results[f"{m}@{n}"] = {**mid, "schedule": results[f"{m}@{n}"].get("schedule", m),
                                       "steady_tok_s": float(np.median([r["steady_tok_s"] for r in runs])),
                                       "rounds_tok_s": [r["tok_s"] for r in runs],
                                       "rounds_steady_tok_s": [r["steady_tok_s"] for r in runs]}
                if m != "delayed":
                    results[f"{m}@{n}"].pop("schedule")
    sweep = {}
    if sweep_here:
        b0 = pred.get("first_round", pred)["best_thresholds"][0]  # the small threshold delayed ran with
        sweep = run_sweep(lambda th: run("delayed", n, total, th), n, b0, args.rounds)
    return results, pred, sweep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=PAIRS, default="cpu-tiny")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--modes", default="sync,eager,delayed")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=None, help="separate runs: requests a client (default 2)")
    ap.add_argument("--min-requests", type=int, default=None,
                    help="separate runs (default 8): at least this many requests a run: at N = 1, 2 requests (~2.5 s) moved a run by 15%%")
    ap.add_argument("--delayed-thresholds", choices=("model", "auto"), default="model")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run sync, eager and delayed (and each --sweep point) this many times each, in turn, "
                         "and report each one's median run (at N = 1 the three are one schedule, and runs of it "
                         "differ by 5-8 %%)")
    ap.add_argument("--sweep", action="store_true", help="also run delayed at every large threshold 1..N")
    ap.add_argument("--sweep-rounds", type=int, default=None, metavar="K",
                    help="with --interleave --sweep: the sweep's points in K of the cycles, evenly spaced (default: every cycle)")
    ap.add_argument("--confirm", type=int, default=0, metavar="K",
                    help="with --interleave --sweep: then K more cycles of the sweep points within "
                         "--confirm-margin of the best so far and of the predicted best")
    ap.add_argument("--confirm-margin", type=float, default=0.06, metavar="SHARE",
                    help="with --confirm: points within this share of the best measured are measured again")
    ap.add_argument("--race", type=int, default=0, metavar="K",
                    help="with --interleave --sweep: then the predicted best point against the best other one, "
                         "in K pairs of windows (bench.modes_interleaved.race_read), which decide the measured best B")
    ap.add_argument("--race-modes", type=int, default=0, metavar="K",
                    help="with --interleave: at every N, delayed against the better of sync and eager in K pairs "
                         "of windows (bench.modes_interleaved.race_read)")
    ap.add_argument("--sweep-at", default=None, metavar="N,...",
                    help="with --sweep: only at these N (default: every N > 1); a sweep at N is N points x --rounds runs")
    ap.add_argument("--no-stagger", dest="stagger", action="store_false",
                    help="start every client with a full-length request (default: client k's first request has "
                         "(k + 1) / N of the tokens, and the steady window starts once all first requests ended)")
    ap.add_argument("--interleave", action="store_true",
                    help="measure the schedules in turn on one router under one unbroken closed loop "
                         "(bench/modes_interleaved.py): --rounds cycles of --window s windows, each after --settle s")
    ap.add_argument("--window", type=float, default=5.0, help="with --interleave: seconds measured a window")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="with --interleave: seconds under a newly set schedule before its window")
    ap.add_argument("--window-lives", type=float, default=2.0,
                    help="with --interleave: a window is also at least this many request lifetimes")
    ap.add_argument("--window-requests", type=int, default=8,
                    help="with --interleave: and holds at least this many answered requests")
    ap.add_argument("--settle-lives", type=float, default=0.5,
                    help="with --interleave: and its settle at least this many")
    ap.add_argument("--quiet-gate", type=float, default=None, metavar="CORES",
                    help="measure only while other processes use fewer cores than this")
    ap.add_argument("--quiet-patience", type=float, default=300.0, metavar="SECONDS",
                    help="longest wait for quiet before measuring anyway (the run records the load)")
    ap.add_argument("--keep-spans", action="store_true",
                    help="also write DIR/spans.json.gz: every run's and sweep point's forwards (start, end, batch, "
                         "tokens) per model, for refitting the step costs offline")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    ns = [int(x) for x in args.concurrency.split(",")]
    sweep_at = None if args.sweep_at is None else {int(x) for x in args.sweep_at.split(",")}
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in ("sync", "eager", "delayed")]
    if unknown or not ns or min(ns) < 1:
        ap.error(f"modes must be sync, eager, delayed (got {unknown}) and N >= 1")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if (args.confirm or args.race or args.race_modes) and not args.interleave:
        ap.error("--confirm, --race and --race-modes apply to --interleave")
    if args.sweep_rounds is not None and not args.interleave:
        ap.error("--sweep-rounds applies to --interleave (separate runs sweep --rounds times)")
    if args.interleave:
        if set(modes) != {"sync", "eager", "delayed"} or args.delayed_thresholds != "model" or args.quiet_gate is not None:
            ap.error("--interleave measures sync, eager and delayed (model thresholds) together; "
                     "--modes, --delayed-thresholds auto and --quiet-gate apply to separate runs only")
        if args.requests_per_client is not None or args.min_requests is not None:
            ap.error("--requests-per-client and --min-requests size separate runs; --interleave measures "
                     "--rounds cycles of --window s windows instead")
        if args.confirm < 0 or (args.confirm and not args.sweep) or not 0 <= args.confirm_margin < 1:
            ap.error("--confirm K >= 0 needs --sweep, and --confirm-margin is a share in [0, 1)")
        if args.race < 0 or (args.race and not args.sweep):
            ap.error("--race K >= 0 needs --sweep")
        if args.race_modes < 0:
            ap.error(f"--race-modes K must be >= 0, got {args.race_modes}")
        if args.sweep_rounds is not None and not 1 <= args.sweep_rounds <= args.rounds:
            ap.error(f"--sweep-rounds must be between 1 and --rounds ({args.rounds}), got {args.sweep_rounds}")
        if args.window <= 0 or args.window_requests < 1 or min(args.settle, args.window_lives, args.settle_lives) < 0:
            ap.error("--window must be > 0, --window-requests >= 1, and --settle, --window-lives, --settle-lives >= 0")
    args.requests_per_client = 2 if args.requests_per_client is None else args.requests_per_client
    args.min_requests = 8 if args.min_requests is None else args.min_requests
    pair = load_pair(args.pair)
    prompts = W.short_prompts(seed=0, count=64, vocab=min(pair.vocab, W.VOCAB))
    gate = args.quiet_gate
    prof, prof_load = gated_profile(pair, max(ns), gate, args.quiet_patience)

    def run(mode, n, total, th):
        return gated(gate, lambda: asyncio.run(run_once(pair, mode, n, prompts, args.tokens, total, th, args.stagger)),
                     args.quiet_patience)

    tpl_P, tpl_C = _template(pair)
    results, predictions, sweeps, summary, spans = {}, {}, {}, {}, {}
    for n in tqdm(ns, desc=f"modes {args.pair}"):
        sweep_here = args.sweep and n > 1 and (sweep_at is None or n in sweep_at)
        at_n, pred, sweep = (asyncio.run(interleaved_at(pair, n, args, prof, tpl_P, tpl_C, sweep_here))
                             if args.interleave else separate_at(run, n, args, modes, prof, tpl_P, tpl_C, sweep_here))
        results.update(at_n)
        predictions[n] = pred
        if sweep:
            sweeps[n] = sweep
        for key in [k for k in results if k.endswith(f"@{n}")]:
            mode = results[key].get("schedule", key.split("@")[0])  # delayed@N may have run eager or sync
            th = results[key].get("thresholds")
            b = tuple(th[x] for x in prof.names) if isinstance(th, dict) and mode == "delayed" else None
            results[key]["predicted_tok_s"] = predicted_for(pred, mode, b)
            results[key]["startup_predicted_tok_s"] = predicted_for(pred["startup"], mode, b)
            if "sync_eager_fit" in pred:
                results[key]["sync_eager_fit_predicted_tok_s"] = predicted_for(pred["sync_eager_fit"], mode, b)
        summary[n] = summarise(n, results, pred, sweep)
        print(json.dumps({"N": n, **summary[n]}, default=float))
        # (thousands of spans a run: used above, and kept apart with --keep-spans)
        at_n = {key: results[key].pop("spans", None) for key in results if key.endswith(f"@{n}")}
        at_n.update({f"sweep {b}": v.pop("spans", None) for b, v in sweep.items()})
        if args.keep_spans:
            spans[n] = at_n
    data = {"machine": machine(), "pair": args.pair, "policy": pair.policy,
            "policy_args": interleaved_policy_args(pair) if args.interleave else pair.policy_args,
            "tokens": args.tokens, "requests_per_client": args.requests_per_client, "staggered": args.stagger,
            "min_requests": args.min_requests, "sweep_at": sorted(sweep_at) if sweep_at else None,
            "delayed_thresholds": args.delayed_thresholds, "quiet_gate_cores": gate,
            "interleave": {"window_s": args.window, "settle_s": args.settle, "window_lives": args.window_lives,
                           "window_requests": args.window_requests, "settle_lives": args.settle_lives,
                           "cycles": args.rounds, "sweep_cycles": args.sweep_rounds or args.rounds,
                           "confirm_cycles": args.confirm, "race_pairs": args.race, "race_modes_pairs": args.race_modes,
                           "prompts": "each cycle's windows the same (cycle_prompt)",
                           "prefix_caching": False} if args.interleave else None,
            "profile": {**prof.describe(), "outside_load_cores": prof_load},
            "template_P": tpl_P.tolist(), "results": results, "predictions": predictions, "sweep": sweeps,
            "summary": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "modes.json"
    path.write_text(json.dumps(data, indent=1, default=float))
    print(f"wrote {path}")
    if args.keep_spans:
        with gzip.open(args.out / "spans.json.gz", "wt") as f:
            json.dump({str(n): {k: v for k, v in by.items() if v is not None} for n, by in spans.items()}, f)
        print(f"wrote {args.out / 'spans.json.gz'}")
    return 0


def _template(pair) -> tuple[np.ndarray, np.ndarray]:
    from policies import make_policy
    P, C = make_policy(pair.policy, pair.policy_args).routing_template()
    return np.asarray(P, dtype=float), np.asarray(C, dtype=float)


if __name__ == "__main__":
    raise SystemExit(main())
