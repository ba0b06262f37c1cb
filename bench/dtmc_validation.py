"""The throughput model against the runtime (the paper's Figure 10 experiment, on SimEngine).

R2R-like routing (`random`, p = 0.35), small 6.0 ms and large 27.9 ms per step, B_0 = 1 and B_1
from 1 to N, at N = 2, 3, 4, 6, 8 closed-loop clients. The model is fed the step latencies the
sim engines actually take in the runtime, and its prediction and best B_1 are compared with what
the runtime measures. The step times are those a router learns: profiled at start-up from its
event loop (so the thread hop of every step, 0.1-0.7 ms depending on load, is in them), plus the
event loop's own work around each step (scheduling, routing, commits, handling the handoffs),
which a router measures while serving (`TuningService.step_costs`; it re-solves with it). Here a
tuned router serves `--learn-seconds` of the N = max closed loop to learn it; both predictions
(with and without that cost) are recorded.

Each point is measured `--repeats` times, the points of one N in turn and each pass in rotated
order, and its figure is the median: one pass's worst point (N = 8, B_1 = 8, +8.5 % against the
prediction) read +0.7..+3.5 % in three repeats run straight after it (a ~7 % run-to-run spread on
the 2-core VM).

    python -m bench.dtmc_validation [--seconds 4] [--concurrency 2,3,4,6,8] [--repeats 3]
    python -m bench.dtmc_validation background [--pair cpu-tiny|smollm2] [--batch 4] [--tokens 7]
                                               [--threads 1,2] [--seconds 4] [--out DIR]

`background`: what other work on the CPU costs a model's forwards, a cost the chain does not
charge (it charges contention per second of overlap with the other model's forwards only). The
pair's large model steps `--batch` sequences, `--tokens` tokens each (an extend, as after a
handoff), in a worker thread with a `--threads` intra-op team, for `--seconds` per condition:
alone, and beside a second thread that works in bursts and sleeps 2 ms between them, its bursts
either pure Python (holding the GIL, like the event loop's work and a small model's dispatch) or
hashing (releasing it, like a forward's kernels). Why: on cpu-tiny the large model's forwards ran
1.24-1.37x the start-up profile in schedules that interleave the two models, even in steps the
small model's forwards overlapped less than 10 % of their time, and 0.86x where the schedule kept
them apart. Writes DIR/background_cost.json: per team size and condition, the median step in ms
and its ratio to the step alone.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from tqdm import tqdm

from aiorouter import Router, RouterConfig
from aiorouter.tuning import SystemSpec, solve_grid
from bench.common import RESULTS, commas, load_pair, rotated, subcommands, write_json

P, L0, L1 = 0.35, 6.0, 27.9


async def measure(n: int, b1: int, seconds: float, max_tokens: int, seed: int) -> float:
    models = {"small": {"engine": "sim", "latency_ms": L0}, "large": {"engine": "sim", "latency_ms": L1}}
    async with Router(models, RouterConfig(policy="random", policy_args={"p": P, "seed": seed}, mode="delayed",
                      thresholds={"small": 1, "large": b1}, max_concurrency=max(8, n))) as r:
        stop = time.perf_counter() + seconds
        start_tokens, t_start = None, None

        async def worker():
            while time.perf_counter() < stop:
                async for _ in r.stream("x", max_tokens=max_tokens, ignore_eos=True):
                    pass

        async def sampler():
            nonlocal start_tokens, t_start
            await asyncio.sleep(min(1.0, seconds / 4))  # warm-up: let the closed loop reach steady state
            start_tokens, t_start = r.metrics.tokens_committed, time.perf_counter()

        ws = [asyncio.create_task(worker()) for _ in range(n)]
        await sampler()
        await asyncio.sleep(max(0.0, stop - time.perf_counter()))
        tokens, t_end = r.metrics.tokens_committed, time.perf_counter()
        for w in ws:
            w.cancel()
        await asyncio.gather(*ws, return_exceptions=True)
        return (tokens - start_tokens) / (t_end - t_start)


async def router_profile(n_max: int, learn_seconds: float, max_tokens: int) -> tuple[list, list, dict]:
    """The step times a router learns (thresholds="auto"): -> (profiled at start-up, profiled plus
    the loop's work per step measured while serving `learn_seconds` of an n_max closed loop, raw
    profile). The profile times each step from the event loop through the model's worker, so the
    hop to the worker and back is in L(b) (engines.profile.profile_dispatched_latency)."""
    models = {"small": {"engine": "sim", "latency_ms": L0}, "large": {"engine": "sim", "latency_ms": L1}}
    async with Router(models, RouterConfig(policy="random", policy_args={"p": P}, tune_concurrency=n_max,
                      max_concurrency=n_max)) as r:
        await r.wait_tuned()
        stop = time.perf_counter() + learn_seconds

        async def worker():
            while time.perf_counter() < stop:
                async for _ in r.stream("x", max_tokens=max_tokens, ignore_eos=True):
                    pass

        await asyncio.gather(*(worker() for _ in range(n_max)))
        costs = r.tuning.step_costs()
        if costs is None:
            raise RuntimeError(f"{learn_seconds} s of serving gave too few steps to measure the loop's work per step")
        profiled = list(r.tuning.tuner.config.latency)
        return profiled, list(r.tuning.tuner.with_step_cost(costs)), dict(r.tuning.profiled)


def validate(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dtmc_validation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="2,3,4,6,8")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="runs a point; its figure is their median")
    ap.add_argument("--learn-seconds", type=float, default=8.0, help="serving before measuring, to learn the loop's work per step")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    ns = commas(args.concurrency, int)
    profiled, (lat0, lat1), raw = asyncio.run(router_profile(max(ns), args.learn_seconds, args.max_tokens))
    spec = SystemSpec.build([[1 - P, P], [1.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]], [lat0, lat1], delta=1e-4)
    spec_profile = SystemSpec.build([[1 - P, P], [1.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]], profiled, delta=1e-4)
    nominal = SystemSpec.build([[1 - P, P], [1.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]], [L0 / 1000, L1 / 1000], delta=1e-4)
    rows = []
    with tqdm(total=sum(ns) * args.repeats, desc="dtmc validation") as bar:
        for n in ns:
            Bs = [(1, b1) for b1 in range(1, n + 1)]
            pred = solve_grid(spec, n, Bs)
            pred_profile = solve_grid(spec_profile, n, Bs)
            pred_nominal = solve_grid(nominal, n, Bs)
            runs: dict[int, list[float]] = {b1: [] for _, b1 in Bs}
            for rep in range(args.repeats):
                for b1 in rotated(list(runs), rep):  # pass rep starts rep points later
                    runs[b1].append(asyncio.run(measure(n, b1, args.seconds, args.max_tokens,
                                                        seed=n * 100 + b1 + 100_000 * rep)))
                    bar.update(1)
            for (_, b1), pr, pp, pn in zip(Bs, pred, pred_profile, pred_nominal):
                meas = float(np.median(runs[b1]))
                rows.append({"N": n, "B1": b1, "predicted": pr.throughput, "predicted_profile_only": pp.throughput,
                             "predicted_nominal_latency": pn.throughput, "measured": meas, "measured_runs": runs[b1],
                             "error": pr.throughput / meas - 1, "error_profile_only": pp.throughput / meas - 1})
    summary = []
    for n in ns:
        rs = [r for r in rows if r["N"] == n]
        bp = max(rs, key=lambda r: r["predicted"])
        bm = max(rs, key=lambda r: r["measured"])
        gap = 1 - bp["measured"] / bm["measured"]
        summary.append({"N": n, "best_B1_predicted": bp["B1"], "best_B1_measured": bm["B1"],
                        "measured_gap_of_predicted_best": gap, "ok": bp["B1"] == bm["B1"] or gap <= 0.02,
                        "max_abs_error": max(abs(r["error"]) for r in rs)})
    data = {"p": P, "latency_ms": [L0, L1], "profiled_latency_s": raw, "seconds": args.seconds, "repeats": args.repeats,
            "fitted_profile": {"small": [profiled[0].a, profiled[0].c], "large": [profiled[1].a, profiled[1].c]},
            "fitted": {"small": [lat0.a, lat0.c], "large": [lat1.a, lat1.c]}, "rows": rows, "summary": summary}
    path = write_json("dtmc_validation", data)
    from bench.plots import dtmc_validation
    dtmc_validation(rows, ns, RESULTS / "dtmc_validation.png")
    lines = [f"Step times (ms, L(b) = a + c b): profiled small {profiled[0].a * 1e3:.2f} + {profiled[0].c * 1e3:.3f} b, "
             f"large {profiled[1].a * 1e3:.2f} + {profiled[1].c * 1e3:.3f} b; with the loop's work per step small "
             f"{lat0.a * 1e3:.2f} + {lat0.c * 1e3:.3f} b, large {lat1.a * 1e3:.2f} + {lat1.c * 1e3:.3f} b.", "",
             f"Measured: the median of {args.repeats} run(s) a point, {args.seconds:g} s each (the runs in brackets).", "",
             "| N | B1 | predicted tok/s | measured tok/s | runs | error | error, profile only |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['N']} | {r['B1']} | {r['predicted']:.1f} | {r['measured']:.1f} | "
              f"{' / '.join(f'{x:.1f}' for x in r['measured_runs'])} | {r['error']:+.1%} "
              f"| {r['error_profile_only']:+.1%} |" for r in rows]
    lines += ["", "| N | best B1 predicted | best B1 measured | measured loss at predicted best | max error |",
              "|---|---|---|---|---|"]
    lines += [f"| {s['N']} | {s['best_B1_predicted']} | {s['best_B1_measured']} | {s['measured_gap_of_predicted_best']:.1%} "
              f"| {s['max_abs_error']:.1%} |" for s in summary]
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0


# -- background: what other work on the CPU costs a model's step ----------------------------------
GAP_MS = 2.0  # the background's sleep between bursts
BURSTS_MS = (0.5, 2.0)  # 0.5 ms a burst: about a fifth of one core, 2 ms: half
_BUF = bytes(range(256)) * 4096  # 1 MiB: sha256 releases the GIL while it hashes a buffer this size


def _python_work() -> None:
    x = 0
    for i in range(200):
        x += i * i


def _gil_free_work() -> None:
    hashlib.sha256(_BUF).digest()


def _burst(work, ms: float) -> None:
    """Call `work` over and over for `ms` milliseconds."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        work()


BURSTS = {"python": _python_work, "gil_free": _gil_free_work}  # a burst's unit of work, by kind


def median_step_ms(step, threads: int, seconds: float, burst: str | None = None, burst_ms: float = 0.0) -> float:
    """Median ms of `step()` run back to back for `seconds` in a worker thread with a `threads`
    team (the first three steps left out), beside a `burst` thread (None: alone)."""
    stop, times, errors = threading.Event(), [], []

    def worker() -> None:
        try:
            torch.set_num_threads(threads)  # per thread: this worker's team only, as the router's workers
            while not stop.is_set():
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
        except BaseException as e:  # noqa: BLE001 - reported below, in the caller's thread
            errors.append(e)

    def background() -> None:
        while not stop.is_set():
            _burst(BURSTS[burst], burst_ms)
            time.sleep(GAP_MS / 1e3)

    threads_ = [threading.Thread(target=worker)] + ([threading.Thread(target=background)] if burst else [])
    for t in threads_:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads_:
        t.join()
    if errors:
        raise RuntimeError(f"the model's step failed: {errors[0]!r}") from errors[0]
    if len(times) < 5:
        raise RuntimeError(f"only {len(times)} steps in {seconds} s: give it more --seconds")
    return 1e3 * statistics.median(times[3:])


def background_cost(step, teams: list[int], seconds: float) -> dict:
    """{team: {condition: {"step_ms", "over_alone"}}} for every team size and condition."""
    out = {}
    for team in teams:
        alone = median_step_ms(step, team, seconds)
        row = {"alone": {"step_ms": alone, "over_alone": 1.0}}
        for kind in BURSTS:
            for ms in BURSTS_MS:
                got = median_step_ms(step, team, seconds, kind, ms)
                row[f"{kind} {ms:g}/{GAP_MS:g} ms"] = {"step_ms": got, "over_alone": got / alone}
        out[str(team)] = row
    return out


def background(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dtmc_validation background",
                                 description="a model's step alone and beside bursts of other work")
    ap.add_argument("--pair", choices=("cpu-tiny", "smollm2"), default="cpu-tiny")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=7, help="tokens a sequence computes a step (cpu-tiny's tau ~7.3)")
    ap.add_argument("--threads", default="1,2", help="team sizes to measure")
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds a condition")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    teams = commas(args.threads, int)
    if args.batch < 1 or args.tokens < 1 or args.seconds <= 0 or min(teams) < 1:
        ap.error("--batch, --tokens and every --threads must be >= 1, and --seconds > 0")
    from engines.engine import Engine
    from engines.profile import DecodeBatch
    engine = Engine(load_pair(args.pair).large)
    batch = DecodeBatch(engine, args.batch)
    try:
        batch.prefill()
        res = background_cost(lambda: batch.step(tokens=args.tokens), teams, args.seconds)
    finally:
        batch.close()
    path = write_json("background_cost", {"pair": args.pair, "model": "large", "batch": args.batch,
                                          "tokens": args.tokens, "seconds": args.seconds, "gap_ms": GAP_MS,
                                          "results": res}, args.out)
    for team, row in res.items():
        print(f"team {team}: " + ", ".join(f"{k} {v['step_ms']:.1f} ms ({v['over_alone']:.2f}x)" for k, v in row.items()))
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return subcommands(argv, validate, background=background)


if __name__ == "__main__":
    raise SystemExit(main())
