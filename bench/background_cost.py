"""What other work on the CPU costs a model's forwards: the cost the chain does not yet charge.

    python -m bench.background_cost [--pair cpu-tiny|smollm2] [--batch 4] [--tokens 7]
                                    [--threads 1,2] [--seconds 4] [--out DIR]

The pair's large model steps `--batch` sequences, `--tokens` tokens each (an extend, as after a
handoff), in a worker thread with a `--threads` intra-op team, for `--seconds` per condition: alone,
and beside a second thread that works in bursts and sleeps 2 ms between them, its bursts either
pure Python (holding the GIL, like the event loop's work and a small model's dispatch) or hashing
(releasing it, like a forward's kernels). Why: on cpu-tiny the large model's forwards ran 1.24-1.37x
the start-up profile in schedules that interleave the two models, even in steps the small model's
forwards overlapped less than 10 % of their time, and 0.86x where the schedule kept them apart
(bench/RESULTS.md, "A race decides the measured best B"); the chain charges contention per second
of overlap with the other model's forwards only. Writes DIR/background_cost.json: per team size
and condition, the median step in ms and its ratio to the step alone.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import RESULTS, machine

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


def measure(step, teams: list[int], seconds: float) -> dict:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=("cpu-tiny", "smollm2"), default="cpu-tiny")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=7, help="tokens a sequence computes a step (cpu-tiny's tau ~7.3)")
    ap.add_argument("--threads", default="1,2", help="team sizes to measure")
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds a condition")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    teams = [int(x) for x in args.threads.split(",")]
    if args.batch < 1 or args.tokens < 1 or args.seconds <= 0 or min(teams) < 1:
        ap.error("--batch, --tokens and every --threads must be >= 1, and --seconds > 0")
    from bench.run import load_pair
    from engines.engine import Engine
    from engines.profile import DecodeBatch
    engine = Engine(load_pair(args.pair).large)
    batch = DecodeBatch(engine, args.batch)
    try:
        batch.prefill()
        res = measure(lambda: batch.step(tokens=args.tokens), teams, args.seconds)
    finally:
        batch.close()
    data = {"machine": machine(), "pair": args.pair, "model": "large", "batch": args.batch, "tokens": args.tokens,
            "seconds": args.seconds, "gap_ms": GAP_MS, "results": res}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "background_cost.json").write_text(json.dumps(data, indent=1))
    for team, row in res.items():
        print(f"team {team}: " + ", ".join(f"{k} {v['step_ms']:.1f} ms ({v['over_alone']:.2f}x)" for k, v in row.items()))
    print(f"wrote {args.out / 'background_cost.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
