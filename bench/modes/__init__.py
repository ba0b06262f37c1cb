"""The runtime's schedules side by side (`sync`, `eager`, `delayed`) on a real pair, each next to
what the throughput model predicts for it (bench/modes/model.py says from what).

    python -m bench.modes --pair cpu-tiny|smollm2 [--concurrency 1,4,8,16] [--tokens 64] [--rounds 4]
                          [--window 5] [--settle 1] [--window-lives 2] [--window-requests 8] [--settle-lives 0.5]
                          [--sweep [--sweep-at 4,8] [--sweep-rounds K] [--confirm K] [--race K]] [--race-modes K]
                          [--no-stagger] [--out DIR]
    python -m bench.modes report DIR/modes.json [...] [--plot PNG]   # a run's tables (bench/modes/report.py)

Every schedule at N is measured on one router under one unbroken closed loop, in windows that
take turns (bench/modes/interleaved.py says why: separate runs of one schedule differed by
10-30 % on the 2-core VMs; bench/modes/cycles.py runs the cycles). Per N: the model, fitted on
the sync and eager windows served so far, names what delayed runs (delayed with its best B, or
eager, or sync, whichever it predicts best; recorded as "schedule"). `--sweep` also runs delayed
at every large-model threshold 1..N (the small one as predicted), pooling delayed's windows where
delayed ran that point; `--confirm K` measures the points near the measured top (and the
predicted best) K cycles more (`bench.modes.cycles.contenders`); the measured best B is also read
with each window against its cycle's sync and eager windows (`blocked_best_B_measured`). `--race K`
then races the predicted best point against the best other one in K pairs of fresh windows, which
decide the measured best B (`race_best_B_measured`; bench.modes.interleaved.race_read says why),
and `--race-modes K` races delayed against the better of sync and eager at every N
(`race_delayed`: the ratio and its standard error).

The chain describes a stationary closed loop: N requests in flight at spread phases. Clients that
start together with equal lengths stay in step instead (every prompt of a cohort prefilled at
once), so by default client k's first request has (k + 1) / N of the tokens. Writes
DIR/modes.json: {"results": {"<mode>@<N>": {"tok_s", "predicted_tok_s", ...}},
"predictions": {N: ...}, "sweep": {N: {"<B>": {...}}}, "summary": {N: ...}}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.common import RESULTS, OutsideLoad, cache_dir, machine
from bench.modes.cycles import interleaved_at, interleaved_policy_args
from bench.modes.interleaved import race_read
from bench.modes.model import predicted_for, profile_pair
from bench.common import PAIRS, load_pair


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.modes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=PAIRS, default="cpu-tiny")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4, help="cycles of sync, eager and delayed windows at each N")
    ap.add_argument("--sweep", action="store_true", help="also run delayed at every large threshold 1..N")
    ap.add_argument("--sweep-rounds", type=int, default=None, metavar="K",
                    help="with --sweep: the sweep's points in K of the cycles, evenly spaced (default: every cycle)")
    ap.add_argument("--sweep-at", default=None, metavar="N,...", help="with --sweep: only at these N (default: every N > 1)")
    ap.add_argument("--confirm", type=int, default=0, metavar="K",
                    help="with --sweep: then K more cycles of the sweep points within "
                         "--confirm-margin of the best so far and of the predicted best")
    ap.add_argument("--confirm-margin", type=float, default=0.06, metavar="SHARE",
                    help="with --confirm: points within this share of the best measured are measured again")
    ap.add_argument("--race", type=int, default=0, metavar="K",
                    help="with --sweep: then the predicted best point against the best other one, "
                         "in K pairs of windows (bench.modes.interleaved.race_read), which decide the measured best B")
    ap.add_argument("--race-modes", type=int, default=0, metavar="K",
                    help="at every N, delayed against the better of sync and eager in K pairs "
                         "of windows (bench.modes.interleaved.race_read)")
    ap.add_argument("--no-stagger", dest="stagger", action="store_false",
                    help="start every client with a full-length request (default: client k's first request has "
                         "(k + 1) / N of the tokens)")
    ap.add_argument("--window", type=float, default=5.0, help="seconds measured a window")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds under a newly set schedule before its window")
    ap.add_argument("--window-lives", type=float, default=2.0,
                    help="a window is also at least this many request lifetimes")
    ap.add_argument("--window-requests", type=int, default=8, help="and holds at least this many answered requests")
    ap.add_argument("--settle-lives", type=float, default=0.5, help="and its settle at least this many")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    ns = [int(x) for x in args.concurrency.split(",")]
    sweep_at = None if args.sweep_at is None else {int(x) for x in args.sweep_at.split(",")}
    if not ns or min(ns) < 1:
        ap.error("N must be >= 1")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
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
    pair = load_pair(args.pair)
    with OutsideLoad() as outside:
        prof = profile_pair({"small": pair.small, "large": pair.large}, max(ns), cache_dir() / "contention")

    tpl_P, tpl_C = _template(pair)
    results, predictions, sweeps, summary = {}, {}, {}, {}
    for n in tqdm(ns, desc=f"modes {args.pair}"):
        sweep_here = args.sweep and n > 1 and (sweep_at is None or n in sweep_at)
        at_n, pred, sweep = asyncio.run(interleaved_at(pair, n, args, prof, tpl_P, tpl_C, sweep_here))
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
        # thousands of spans a run: used above, too many for modes.json
        for key in [k for k in results if k.endswith(f"@{n}")]:
            results[key].pop("spans", None)
        for v in sweep.values():
            v.pop("spans", None)
    data = {"machine": machine(), "pair": args.pair, "policy": pair.policy,
            "policy_args": interleaved_policy_args(pair), "tokens": args.tokens, "staggered": args.stagger,
            "sweep_at": sorted(sweep_at) if sweep_at else None,
            "interleave": {"window_s": args.window, "settle_s": args.settle, "window_lives": args.window_lives,
                           "window_requests": args.window_requests, "settle_lives": args.settle_lives,
                           "cycles": args.rounds, "sweep_cycles": args.sweep_rounds or args.rounds,
                           "confirm_cycles": args.confirm, "race_pairs": args.race, "race_modes_pairs": args.race_modes,
                           "prompts": "each cycle's windows the same (cycle_prompt)", "prefix_caching": False},
            "profile": {**prof.describe(), "outside_load_cores": outside.cores},
            "template_P": tpl_P.tolist(), "results": results, "predictions": predictions, "sweep": sweeps,
            "summary": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "modes.json"
    path.write_text(json.dumps(data, indent=1, default=float))
    print(f"wrote {path}")
    return 0


def _template(pair) -> tuple[np.ndarray, np.ndarray]:
    from policies import make_policy
    P, C = make_policy(pair.policy, pair.policy_args).routing_template()
    return np.asarray(P, dtype=float), np.asarray(C, dtype=float)

