"""`bench.modes`' driver: every schedule at N measured in cycles of windows on one
router under one closed loop (bench/modes/interleaved.py has the loop and the readings), the
sweep's points among them, and the races that settle what the sweep cannot tell apart.

bench/modes/__init__.py parses the options and writes the results; this module runs one N.
"""
from __future__ import annotations

import asyncio
import os
from typing import Callable

from tqdm import tqdm

from aiorouter import Router, RouterConfig
from bench import workloads as W
from bench.common import OutsideLoad, closed_loop, rotated
from bench.modes.interleaved import SteadyLoop, blocked, cycle_reference, pooled, race_order
from bench.modes.model import FIT_KEYS, delayed_choice, model_at

WARMUP_TOKENS = 16  # output tokens of the warm-up requests, before anything is measured


def stagger(tokens: int, n: int, k: int) -> int:
    """Output tokens of client k's first request in a staggered start: (k + 1) / n of the full
    length, so the clients' requests end at phases spread over one request's life."""
    return max(1, round(tokens * (k + 1) / n))


# what a sweep point keeps of its pooled windows (of its median run, separately)
SWEEP_KEYS = ("tok_s", "steady_tok_s", "mean_in_flight", "mean_batch", "busy", "step_ms", "load_avg", "outside_load_cores")


def spread(k: int, rounds: int) -> set[int]:
    """k of cycles 0..rounds-1, evenly spaced from the first: where the sweep's points run. The
    first k cycles instead put the sweep in the run's first half and the modes' last windows
    after it, and the machine drifts in between (cpu-tiny, 2026-12-03, N = 16: a large-model step
    at 0.8x the start-up profile in the first cycles, 1.0-1.7x in the last)."""
    return {(i * rounds) // k for i in range(k)}


def fresh_prompt(i: int, vocab: int) -> list[int]:
    """Request i's prompt in an interleaved run: drawn as bench.workloads.short_prompts draws
    them, never repeated (a repeat would be a prefix-cache hit, which separate runs never see)."""
    return W.short_prompts(seed=1_000_003 + i, count=1, vocab=min(vocab, W.VOCAB))[0]


def cycle_prompt(cycle: int, i: int, vocab: int) -> list[int]:
    """Request i of every window in cycle `cycle` of an interleaved run (cycle -1: the fitting
    windows): drawn as bench.workloads.short_prompts draws them, apart from fresh_prompt's."""
    return W.short_prompts(seed=7_000_003 * (cycle + 2) + i, count=1, vocab=min(vocab, W.VOCAB))[0]


def interleaved_policy_args(pair) -> dict:
    """The pair's policy arguments for an interleaved run: the random policy's coins drawn from
    the prompt (not the request's uuid), so a cycle's windows, serving the same prompts, route
    them alike (rstitch already routes a prompt one way: greedy decoding and its entropy rule)."""
    return {**pair.policy_args, "key": "prompt"} if pair.policy == "random" else dict(pair.policy_args)


async def interleaved_at(pair, n: int, args, prof, tpl_P, tpl_C, sweep: bool) -> tuple[dict, dict, dict]:
    """Every schedule at N on one router under one closed loop (bench.modes.interleaved): a first
    cycle of sync and eager windows fits the model, which names what delayed runs; then
    `args.rounds` cycles of sync, eager, delayed (and with `sweep`, in `args.sweep_rounds` of them
    spread over the run, every feasible large threshold, the small one B*'s), each cycle in rotated
    order, then `args.confirm` cycles of sync, eager, delayed and the sweep's contenders. The
    final prediction is fitted on every cycle's sync, eager and delayed windows.
    Every window of a cycle serves that cycle's prompts (`cycle_prompt`), in the same order, on a
    router without prefix caching (fresh random prompts share no prefix, so it spares no work
    here, and a prompt served again is computed again). -> (results at N, prediction, sweep)."""
    names = prof.names
    ones = dict.fromkeys(names, 1)
    no_prefix = {"enable_prefix_caching": False}
    models = {"small": {"path": str(pair.small), "engine_config": no_prefix},
              "large": {"path": str(pair.large), "engine_config": no_prefix}}
    async with Router(models, RouterConfig(policy=pair.policy, policy_args=interleaved_policy_args(pair), entry="small",
                                           mode="delayed",
                      thresholds=ones, kv_memory_gb=1.0, max_concurrency=max(16, n))) as r:
        async def send(p):
            async for ev in r.stream(p, max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True):
                yield ev.model

        await closed_loop(send, n, W.warmup_prompts(n, vocab=pair.vocab), n)
        first = (lambda k: stagger(args.tokens, n, k)) if args.stagger and n > 1 else None
        periods = (args.settle, args.window, args.settle_lives, args.window_lives, args.window_requests)
        with OutsideLoad() as outside:
            async with SteadyLoop(r, n, lambda i: fresh_prompt(i, pair.vocab), args.tokens, first) as loop:
                await loop.ramped.wait()  # every client past its staggered first request
                in_cycle = lambda c: lambda i: cycle_prompt(c, i, pair.vocab)  # noqa: E731
                fit = [await loop.measure(m, ones, *periods, prompts=in_cycle(-1)) for m in ("sync", "eager")]
                pred = await asyncio.to_thread(model_at, prof, fit, tpl_P, tpl_C, n)
                sched, th = delayed_choice(pred, names)
                b0 = pred["best_thresholds"][0]  # the sweep runs B*'s small threshold, whatever delayed runs
                modes = [("sync", "sync", ones), ("eager", "eager", ones), ("delayed", sched, th)]
                points = [(f"{b0},{b1}", "delayed", {names[0]: b0, names[1]: b1})
                          for b1 in range(1, n - b0 + 2)] if sweep else []  # feasible: (b0-1) + (b1-1) < n
                windows: dict[str, list[dict]] = {key: [] for key, _, _ in modes + points}
                sweep_cycles = spread(args.sweep_rounds or args.rounds, args.rounds)

                async def cycle(c: int, runs: list) -> None:
                    for key, mode, b in runs:
                        windows[key].append({**await loop.measure(mode, b, *periods, prompts=in_cycle(c)), "cycle": c})

                for rnd in tqdm(range(args.rounds), desc=f"N={n} cycles", leave=False):
                    await cycle(rnd, rotated(modes, rnd) + (rotated(points, rnd) if rnd in sweep_cycles else []))
                if points and args.confirm:
                    # The contenders measured again, in turn (see contenders()), each confirm cycle
                    # with sync, eager and delayed beside them: the points are told apart against
                    # their cycles' sync and eager windows (bench.modes.interleaved.blocked), and the
                    # modes' figures gain windows.
                    fitted = await asyncio.to_thread(model_at, prof, [w for k, _, _ in modes for w in windows[k]],
                                                     tpl_P, tpl_C, n)
                    ref = cycle_reference(windows)
                    again = contenders(point_windows(windows, points, sched, th, names), fitted, args.confirm_margin,
                                       lambda w: blocked(w, ref))
                    again = [p for p in points if p[0] in again]
                    for rnd in tqdm(range(args.confirm), desc=f"N={n} confirm {len(again)}", leave=False):
                        await cycle(args.rounds + rnd, rotated(modes + again, rnd))  # prompts not served before
                first_pred = pred
                # The final prediction is fitted on the measured cycles' forwards, never on the first
                # cycle's (that one only picks what delayed runs): the machine drifts by a quarter
                # within minutes (cpu-tiny, 2026-12-03, N = 4: the large model's steps at 0.91-1.04x
                # the start-up profile in the first cycles, 0.69-0.77x in the last), and the first
                # cycle's slower forwards put the sync and eager predictions 9-12 % under the
                # windows they were compared with, against 2-4 % fitted on those cycles alone.
                # Every schedule the router served counts, delayed's too, as the runtime's own
                # re-solves fit whatever it serves: sync and eager keep the small model's steps
                # overlapped with the large one's, so they cannot tell contention from a slower
                # model; delayed's bursts can (its small-model steps at 0.8-1.1x the profile
                # where they overlap nothing, 1.0-1.5x where they do). The fit on sync and eager
                # alone is kept beside it ("sync_eager_fit").
                served = windows["sync"] + windows["eager"]
                alone = await asyncio.to_thread(model_at, prof, served, tpl_P, tpl_C, n)
                pred = await asyncio.to_thread(model_at, prof, served + windows["delayed"], tpl_P, tpl_C, n)
                pred["sync_eager_fit"] = {k: alone[k] for k in FIT_KEYS}
                raced = await race(loop, n, args, windows, points, pred, (sched, th, names), periods, in_cycle)
                mode_race = await race_modes(loop, n, args, windows, (sched, th, names), periods, in_cycle,
                                             first=args.rounds + args.confirm + (args.race if raced else 0))
    pred["first_round"] = {k: first_pred[k] for k in FIT_KEYS}
    results = {}
    for key, _, _ in modes:
        results[f"{key}@{n}"] = {**pooled(windows[key]), "outside_load_cores": outside.cores,
                                 "load_avg": os.getloadavg()}
        if key != "delayed":
            results[f"{key}@{n}"].pop("schedule")
            results[f"{key}@{n}"].pop("thresholds")
    if mode_race:
        results[f"delayed@{n}"]["race"] = mode_race
    sweep_out = {}
    ref = cycle_reference(windows)
    for key, run_windows in point_windows(windows, points, sched, th, names).items():
        run = pooled(run_windows)
        sweep_out[key] = {**{k: run[k] for k in SWEEP_KEYS if k in run}, "blocked_tok_s": blocked(run_windows, ref),
                          "cycles": [w["cycle"] for w in run_windows], "rounds_tok_s": run["rounds_tok_s"],
                          "rounds_steady_tok_s": run["rounds_steady_tok_s"], "spans": run["spans"]}
        if key in raced:
            sweep_out[key]["race_tok_s"] = raced[key]
    return results, pred, sweep_out


async def race(loop: SteadyLoop, n: int, args, windows: dict, points: list, pred: dict, ran: tuple,
               periods: tuple, in_cycle: Callable) -> dict[str, list[float]]:
    """With --race K: the chain's best sweep point (the final prediction's, as `sweep_read` reads
    it) against the best other point, each window against its cycle (`blocked`), in K pairs of
    windows after every cycle. -> {point: its race windows' tok/s} ({} without a race).
    bench.modes.interleaved.race_read says why a race decides the measured best B, and reads it."""
    if not args.race or len(points) < 2:
        return {}
    by = point_windows(windows, points, *ran)
    ref = cycle_reference(windows)
    a = max(by, key=lambda k: pred["by_thresholds"][k])
    b = max((k for k in by if k != a), key=lambda k: blocked(by[k], ref))
    thresholds = {key: t for key, _, t in points}
    return await race_windows(loop, f"N={n} race {a} / {b}", {a: ("delayed", thresholds[a]), b: ("delayed", thresholds[b])},
                              args.race, args.rounds + args.confirm, periods, in_cycle)


async def race_modes(loop: SteadyLoop, n: int, args, windows: dict, ran: tuple, periods: tuple,
                     in_cycle: Callable, first: int) -> dict:
    """With --race-modes K: delayed (the schedule it ran) against the better of sync and eager so
    far (pooled, as the ratio reads them) in K pairs of windows, pair k on cycle first + k's
    prompts. -> {"against", "tok_s", "against_tok_s"} ({} without a race). Where the chain picked
    that very schedule for delayed, the race is one schedule against itself: it still runs, and
    is reported as measured (`summarise` marks it; smollm2, 2026-12-03: eager against itself
    read 0.966-1.036 in 16 pairs)."""
    if not args.race_modes:
        return {}
    sched, th, names = ran
    best = max(("sync", "eager"), key=lambda m: pooled(windows[m])["tok_s"])
    got = await race_windows(loop, f"N={n} race delayed / {best}",
                             {"delayed": (sched, th), best: (best, dict.fromkeys(names, 1))},
                             args.race_modes, first, periods, in_cycle)
    return {"against": best, "tok_s": got["delayed"], "against_tok_s": got[best]}


async def race_windows(loop: SteadyLoop, label: str, two: dict[str, tuple[str, dict]], pairs: int, first: int,
                       periods: tuple, in_cycle: Callable) -> dict[str, list[float]]:
    """Two schedules ({name: (schedule, thresholds)}) in `pairs` pairs of windows (`race_order`),
    pair k serving cycle first + k's prompts (cycles not served before). -> {name: tok/s per window}."""
    out: dict[str, list[float]] = {k: [] for k in two}
    for i, key in enumerate(tqdm(race_order(*two, pairs), desc=label, leave=False)):
        out[key].append((await loop.measure(*two[key], *periods, prompts=in_cycle(first + i // 2)))["tok_s"])
    return out


def point_windows(windows: dict[str, list[dict]], points: list, sched: str, th: dict[str, int],
                  names: list[str]) -> dict[str, list[dict]]:
    """Each sweep point's windows, with delayed's among them where delayed ran that point's
    schedule (the same thresholds, on the same cycles' prompts): more windows of one schedule."""
    same = ",".join(str(th[x]) for x in names) if sched == "delayed" else None
    return {key: windows[key] + (windows["delayed"] if key == same else []) for key, _, _ in points}


def contenders(by_point: dict[str, list[dict]], pred: dict, margin: float,
               rate: Callable[[list[dict]], float] = lambda w: pooled(w)["steady_tok_s"]) -> list[str]:
    """The sweep points worth measuring again: those within `margin` of the best measured so far,
    and the one the chain predicts best among them (as `summarise` reads it). Why: the measured
    best of N noisy points is the luckiest of them; at 2-3 windows a point (cpu-tiny, N = 4: one
    schedule read 131 and 141 tok/s as a sweep point and as delayed), the points near the top are
    told apart by their noise, and the predicted best's shortfall against the measured best read
    up to ~14 % that was chance. `rate`: a point's tok/s from its windows (pooled by default;
    `interleaved_at` reads them against their cycles, `blocked`)."""
    rates = {k: rate(w) for k, w in by_point.items() if w}
    top = max(rates.values())
    keep = [k for k, v in rates.items() if v >= (1 - margin) * top]
    best = max(rates, key=lambda b: pred["by_thresholds"][b])  # the chain's best among the points swept
    return keep + ([best] if best not in keep else [])
