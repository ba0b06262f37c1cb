"""Decode-step latency of an engine at a few batch sizes (the throughput model's L_i(b)), and how
much two engines slow each other when they step at once (its contention term).

Both run through the engine's own runner on private sequences whose KV is freed afterwards (the
engine must be idle). docs/throughput-model.md says how the chain uses them.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence as Seq

import torch

from engines.engine import Engine
from engines.runner import ModelRunner, ScheduledSeq
from engines.sampling import SamplingParams
from engines.sequence import Sequence
from engines.worker import Worker

StepWrap = Callable[[int, Callable[..., object]], Callable[..., object]]


class DecodeBatch:
    """`b` private sequences on `engine`, prefilled; each `step()` decodes one token for all.

    Positions run in a ring of `window` tokens after the prompt (the KV of the ring's start is
    overwritten), so a model can step for as long as a measurement needs in bounded KV.
    """

    def __init__(self, engine: Engine, b: int, prompt_len: int = 32, window: int = 64, salt: int = 0):
        self.engine, self.prompt_len, self.window = engine, prompt_len, window
        vocab = engine.model_config.vocab_size
        self.seqs = [Sequence([(7 * i + 13 * salt + j) % vocab for j in range(prompt_len)],
                              SamplingParams(max_tokens=window + 1, temperature=0.0)) for i in range(b)]
        self.steps = 0
        bm = engine.block_manager
        try:
            for s in self.seqs:
                if not bm.reserve(s, prompt_len + window):
                    raise ValueError(f"not enough KV to profile batch size {b} ({prompt_len + window} tokens "
                                     f"a sequence; {bm.num_free_pages} pages free)")
        except ValueError:
            self.close()
            raise

    def prefill(self) -> None:
        self.engine.runner.run([ScheduledSeq(s, len(s.token_ids)) for s in self.seqs])
        for s in self.seqs:
            s.num_computed_tokens = len(s.token_ids)

    def step(self, run: Callable[..., object] | None = None, tokens: int = 1) -> None:
        """One step computing `tokens` new tokens per sequence (1: a decode; more: an extend, as
        after a handoff or a prompt)."""
        if len(self.seqs[0].token_ids) + tokens > self.prompt_len + self.window:
            for s in self.seqs:  # back to the ring's start: recompute over the same KV slots
                del s.token_ids[self.prompt_len:]
                s.num_computed_tokens = self.prompt_len
        vocab = self.engine.model_config.vocab_size
        for s in self.seqs:
            s.token_ids.extend(1 + (self.steps + k) % (vocab - 1) for k in range(tokens))
        (run or self.engine.runner.run)([ScheduledSeq(s, tokens) for s in self.seqs])
        for s in self.seqs:
            s.num_computed_tokens += tokens
        self.steps += 1

    def close(self) -> None:
        for s in self.seqs:
            self.engine.block_manager.free(s)


async def profile_dispatched_latency(engine: Engine, worker: Worker, batch_sizes: list[int], steps: int = 3,
                                     prompt_len: int = 32, warmup: int = 1, min_seconds: float = 0.15,
                                     max_steps: int = 40) -> dict[int, float]:
    """Median seconds of one decode step at each batch size as the runtime dispatches it: timed on
    the event loop from handing the step to the model's worker (`worker`, as a step makes it) to the loop resuming
    with its result, so the thread hop each way (and any wait for the GIL) counts as step time.

    That hop is a per-step cost the chain would not see in the worker's own timing (`profile_step_latency`): on the
    2-core bench machine under load 5.8, a 6 ms sim step took 6.15 ms inside its worker and
    6.6-6.9 ms seen from the loop. Each size takes at least `steps` steps and goes on (up to
    `max_steps`) until `min_seconds` have passed: a fast model's median then rests on tens of
    steps (three 6 ms steps under load gave one size 8.1 ms against 6.4 for the others), a
    slow model's costs no more than before."""
    out: dict[int, float] = {}
    for b in batch_sizes:
        batch = await worker.call(DecodeBatch, engine, b, prompt_len, 16)
        try:
            await worker.call(batch.prefill)
            times: list[float] = []
            start = time.perf_counter()
            for i in range(warmup + max_steps):
                if len(times) >= steps and time.perf_counter() - start >= min_seconds:
                    break
                t0 = time.perf_counter()
                await worker.call(batch.step)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            out[b] = statistics.median(times)
        finally:
            await worker.call(batch.close)
    return out


def profile_step_latency(engine: Engine, shapes: Seq[tuple[int, int]], steps: int = 3, prompt_len: int = 32,
                         warmup: int = 1) -> dict[tuple[int, int], float]:
    """Median seconds of one step at each (batch, new tokens per sequence) shape.

    A routed model's steps compute more than one token per sequence: a handoff's catch-up
    extend, a first visit's prompt. Decodes and extends together fit step time as a function of
    sequences and tokens (`aiorouter.tuning.fit_step_cost`)."""
    out: dict[tuple[int, int], float] = {}
    for b, t in shapes:
        if b < 1 or t < 1:
            raise ValueError(f"step shape {(b, t)}: batch and tokens per sequence must be >= 1")
        batch = DecodeBatch(engine, b, prompt_len, window=(steps + warmup) * t + 1)
        try:
            batch.prefill()
            times = []
            for i in range(steps + warmup):
                t0 = time.perf_counter()
                batch.step(tokens=t)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            out[(b, t)] = statistics.median(times)
        finally:
            batch.close()
    return out


@dataclass(frozen=True)
class ContentionSample:
    """Model `model` stepping at `batch` while model `other` steps at `other_batch` in its own thread.

    `kappa` is the share of `model`'s progress lost per second that `other` is inside a step: its
    step takes solo_s / (1 - kappa * other_busy) under the measured overlap, so a step that fully
    overlaps the other's steps takes solo_s / (1 - kappa). 0 = unaffected.
    """

    model: int
    other: int
    batch: int
    other_batch: int
    solo_s: float  # median step time alone
    overlapped_s: float  # median step time while the other model steps
    other_busy: float  # share of those steps' time during which the other model was inside a step
    kappa: float


def contention_pairs(num_models: int, cap: int, heavy: int) -> list[tuple[int, int, int, int]]:
    """(model, batch, other, other_batch) runs that matter for delayed batching with the heaviest
    model `heavy`: it at batch 1 and at the cap, against each lighter model at 1 and at cap // 2
    (in the delayed cycle the heavy model runs large batches while the rest cycle on the others)."""
    cap = max(1, int(cap))
    hb = sorted({1, cap})
    lb = sorted({1, max(1, cap // 2)})
    return [(heavy, b, j, c) for j in range(num_models) if j != heavy for b in hb for c in lb]


def _computes(engine: Engine) -> bool:
    """A sim engine sleeps through its steps: it neither slows nor is slowed by another model."""
    return isinstance(engine.runner, ModelRunner)


def _shares_hardware(a: Engine, b: Engine) -> bool:
    """Two models contend on one CPU, or on one GPU; models on different GPUs do not."""
    da, db = a.runner.device, b.runner.device
    return da.type == db.type == "cpu" or da == db


def _checkpoint_id(engine: Engine) -> list:
    """What identifies a checkpoint without reading it: its files' names, sizes and mtimes."""
    path = getattr(engine, "path", None)
    if path is None:
        return []
    return sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(path).iterdir() if f.is_file())


def _loop(batch: DecodeBatch, run: Callable[..., object], quota: int, done: list[threading.Event], me: int,
          log: list[tuple[float, float]]) -> None:
    """Step until this model and the other have each made their quota (so each one's measured
    steps overlap the other's stepping throughout)."""
    while not all(e.is_set() for e in done):
        t0 = time.perf_counter()
        batch.step(run)
        log.append((t0, time.perf_counter()))
        if len(log) >= quota:
            done[me].set()


def _busy_share(spans: list[tuple[float, float]], other: list[tuple[float, float]]) -> float:
    """Share of the time in `spans` during which some interval of `other` was running."""
    total = sum(e - s for s, e in spans)
    covered = sum(max(0.0, min(e, oe) - max(s, os_)) for s, e in spans for os_, oe in other)
    return covered / total if total > 0 else 0.0


def _measure_pair(engines: Seq[Engine], executors: Seq[Executor], runs: Seq[Callable[..., object]],
                  i: int, bi: int, j: int, bj: int, steps: int, warmup: int, window: int) -> list[ContentionSample]:
    x, y = DecodeBatch(engines[i], bi, window=window, salt=1), DecodeBatch(engines[j], bj, window=window, salt=2)
    try:
        executors[i].submit(x.prefill).result()
        executors[j].submit(y.prefill).result()

        def solo(batch: DecodeBatch, run: Callable[..., object]) -> list[float]:
            out = []
            for k in range(steps + warmup):
                t0 = time.perf_counter()
                batch.step(run)
                if k >= warmup:
                    out.append(time.perf_counter() - t0)
            return out

        # The faster model makes as many steps as fit in the slower one's: both quotas are met at
        # about the same time, so neither runs alone for long at the end.
        sx = executors[i].submit(solo, x, runs[i]).result()
        sy = executors[j].submit(solo, y, runs[j]).result()
        tx, ty = statistics.median(sx), statistics.median(sy)
        qx = max(steps + warmup, round((steps + warmup) * ty / tx)) if tx < ty else steps + warmup
        qy = max(steps + warmup, round((steps + warmup) * tx / ty)) if ty < tx else steps + warmup
        done = [threading.Event(), threading.Event()]
        lx: list[tuple[float, float]] = []
        ly: list[tuple[float, float]] = []
        fx = executors[i].submit(_loop, x, runs[i], qx, done, 0, lx)
        fy = executors[j].submit(_loop, y, runs[j], qy, done, 1, ly)
        fx.result(), fy.result()
    finally:
        x.close()
        y.close()
    out = []
    for (m, b, solo_s, log, o, ob, olog) in ((i, bi, tx, lx, j, bj, ly), (j, bj, ty, ly, i, bi, lx)):
        lo, hi = olog[0][0], olog[-1][1]
        inside = [s for s in log[warmup:] if s[0] >= lo and s[1] <= hi] or log[warmup:]
        ov = statistics.median(e - s for s, e in inside)
        busy = _busy_share(inside, olog)
        kappa = (1.0 - solo_s / ov) / busy if busy > 0.05 else 0.0
        out.append(ContentionSample(m, o, b, ob, solo_s, ov, busy, min(0.95, max(0.0, kappa))))
    return out


def profile_contention(engines: Seq[Engine], pairs: Seq[tuple[int, int, int, int]], *, threads: Seq[int],
                       executors: Seq[Executor] | None = None, wrap: StepWrap | None = None, steps: int = 3,
                       warmup: int = 1, cache_dir: Path | None = None) -> list[ContentionSample]:
    """Each model's decode-step time while another model steps concurrently.

    `pairs`: (model, batch, other, other_batch) runs (see `contention_pairs`); each run measures
    both models, each stepping in its own worker thread (`executors[i]`, or a fresh one-thread pool
    with `threads[i]` intra-op threads) through `wrap(i, runner.run)` when given (the runtime's
    `CoreShare.step_fn`: measure with the core lending it serves with). Pairs with a sim engine,
    or on two different GPUs, do not contend and are not run: they yield no sample.

    Cost: each run makes `steps + warmup` steps of the slower model alone, then as many while the
    other steps (each slower by 1 / (1 - kappa)): 13 s for four runs (cpu-tiny, cap 16) and
    18 s (smollm2) on the 2-core bench machine while other jobs held 1.3-1.6 of its cores (not
    yet timed on an idle one). With `cache_dir`, results are kept under a hash of the
    checkpoints' files, devices, dtypes, threads, cores and arguments.
    """
    if len(threads) != len(engines) or (executors is not None and len(executors) != len(engines)):
        raise ValueError(f"need one thread count (and executor) per engine: {len(engines)} engines, "
                         f"{len(threads)} thread counts")
    for (i, bi, j, bj) in pairs:
        if not (0 <= i < len(engines) and 0 <= j < len(engines)) or i == j or bi < 1 or bj < 1:
            raise ValueError(f"bad contention pair {(i, bi, j, bj)}: need two different models of "
                             f"0..{len(engines) - 1} and batch sizes >= 1")
    todo = [p for p in pairs if _computes(engines[p[0]]) and _computes(engines[p[2]])
            and _shares_hardware(engines[p[0]], engines[p[2]])]
    if not todo:
        return []
    entry = None
    if cache_dir is not None:
        key = json.dumps([[_checkpoint_id(e), str(e.runner.device), str(e.dtype)] for e in engines],
                         default=str) + json.dumps([list(threads), todo, steps, warmup, os.cpu_count(),
                                                    torch.__version__, wrap is not None])
        entry = Path(cache_dir) / f"contention-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
        if entry.is_file():
            return [ContentionSample(**d) for d in json.loads(entry.read_text())]
    own = executors is None
    pools = list(executors) if executors is not None else [
        ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(t,)) for t in threads]
    runs = [wrap(k, e.runner.run) if wrap is not None else e.runner.run for k, e in enumerate(engines)]
    try:
        out = []
        for (i, bi, j, bj) in todo:
            out += _measure_pair(engines, pools, runs, i, bi, j, bj, steps, warmup, window=64)
    finally:
        if own:
            for p in pools:
                p.shutdown(wait=True)
    if entry is not None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps([asdict(s) for s in out]))
        tmp.replace(entry)  # a concurrent reader sees the whole file or none
    return out


def runner_info(engine: Engine) -> dict:
    """What an engine runs on, for benchmark records: attention backend, captured graphs (count,
    replays so far, their backend) and its streams (raw handles; none on CPU)."""
    r = engine.runner
    g = r.graphs
    return {"backend": type(r.backend).__name__, "graphs": len(g.graphs) if g else 0,
            "graph_replays": g.num_replays if g else 0, "graph_backend": type(g.backend).__name__ if g else None,
            "streams": [hex(s.cuda_stream) for s in r.streams if s is not None]}
