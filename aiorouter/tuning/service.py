"""The router's tuning service and its background re-solve: a re-solve runs in a child process at
the lowest CPU priority (`BackgroundSolver`).
"""

from __future__ import annotations

import asyncio
from collections import deque
import logging
import threading
import time
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

from .inputs import Contention, LatencyModel, fit_latency, fit_samples
from .learned import MIN_SPANS, ServedFit, StepSpan, TuningCancelled, fit_served
from .dtmc import DEFAULT_TABLE_STATES, choose_delta
from .search import ChildCancelled, ChildProcess
from .tuner import Tuner, TunerConfig

# -------------------- background --------------------
# Re-solves while serving, run in a child process at the lowest CPU priority (search.ChildProcess).
#
# Why: a re-solve of the threshold table is seconds of CPU (cpu-tiny, N = 1..16: ~15 s). Run in a
# thread of the serving process it took those seconds from the models on a CPU host, and held the
# GIL against the event loop and the models' workers on any host: the cpu-tiny pair at N = 16
# (delayed, thresholds "auto", 32 requests) served 158-171 tok/s with the re-solve running
# against 182-206 with the same thresholds fixed and none. One child per re-solve, so a cancelled
# one, or the router that closes, ends it at once (`cancel`) and nothing of it outlives the router.


class BackgroundSolver:
    """`run(fn, *args)` in a fresh child process at the lowest priority, blocking the calling thread
    (not the event loop: call it from a worker thread) until the child answers; `cancel` ends the
    running one and refuses later ones (`ChildCancelled`, a `TuningCancelled`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: ChildProcess | None = None
        self._cancelled = False

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            if self._cancelled:
                raise ChildCancelled("the background solver was cancelled")
            child = self._child = ChildProcess(idle=True)
        try:
            return child.run(fn, *args)
        finally:
            child.close()  # its answer is in (or it failed): it idles, and exits once its stdin closes
            with self._lock:
                self._child = None

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            child = self._child
        if child is not None:
            child.kill()


# -------------------- service --------------------
# The tuner's lifecycle inside a running router: profile each model (its step latency, and how much
# the models slow each other when they share hardware), solve the schedule per concurrency in the
# background (the router serves with B = 1 meanwhile), feed it the routes actually taken, the
# runtime's own work around each step and the spans of the forwards it served, and re-solve when
# any of them moves away from what the schedule was solved for: the table in a child process at
# the lowest CPU priority (`BackgroundSolver`), so that the models keep their cores and the GIL.
#
# It sees models only through profiling callables and hands the schedule to a setter, so it stays
# free of torch and of the router's internals.

log = logging.getLogger("aiorouter")

Profiler = Callable[[list[int]], Awaitable[dict[int, float]]]  # batch sizes -> seconds per decode step
# cap -> measured contention samples (fields model, batch, other, other_batch, kappa); none: no contention
ContentionProfiler = Callable[[int], Awaitable[Sequence[object]]]
Table = dict[int, tuple[int, ...]]  # concurrency N -> B per model
Modes = dict[int, str]  # concurrency N -> "delayed", "eager" or "sync"

RESOLVE_EVERY = 2000  # routing decisions between drift checks
STEP_SAMPLES = 1000  # per model: the runtime's work around its last this many steps ...
MIN_STEP_SAMPLES = 100  # ... of which a step cost needs this many


class TuningService:
    def __init__(self, names: Sequence[str], template: tuple[np.ndarray, np.ndarray], max_concurrency: int,
                 tune_concurrency: int | None, apply: Callable[[Table, Modes], None],
                 resolve_every: int | None = RESOLVE_EVERY):
        """`resolve_every`: routing decisions between drift checks; None: never re-solve (the start-up
        schedule stays)."""
        if resolve_every is not None and (isinstance(resolve_every, bool) or not isinstance(resolve_every, int)
                                          or resolve_every < 1):
            raise ValueError(f"resolve_every must be None or >= 1 routing decisions, got {resolve_every!r}")
        self.names, self.template, self.max_concurrency, self.apply = list(names), template, max_concurrency, apply
        self.cap = min(tune_concurrency or (16 if len(self.names) == 2 else 8), max_concurrency)
        self.resolve_every = resolve_every
        self.tuner: Tuner | None = None
        self.contention: Contention | None = None
        self.profiled: dict[str, dict[int, float]] = {}  # per model: batch size -> seconds per decode step
        # start-up cost, reported in the log and here (seconds): decode profile, contention profile, solve
        self.profile_seconds = self.contention_seconds = self.solve_seconds = 0.0
        self.resolves = 0  # re-solves run after drift
        self.swaps = 0  # ... of which changed the schedule at some N
        self._closing = False
        self._task: asyncio.Task | None = None
        self._resolving: asyncio.Task | None = None
        self._decisions = 0
        # re-solves run in a child process at the lowest priority, not in this one (`BackgroundSolver`)
        self._background = BackgroundSolver()
        # per model: (batch size, seconds of the event loop's work around that step)
        self._steps: list[deque[tuple[int, float]]] = [deque(maxlen=STEP_SAMPLES) for _ in self.names]
        # per model: its recent forwards' spans (what they cost served, and overlapped with)
        self._spans: list[deque[StepSpan]] = [deque(maxlen=STEP_SAMPLES) for _ in self.names]
        self._hops: list[deque[float]] = [deque(maxlen=STEP_SAMPLES) for _ in self.names]

    async def start(self, profilers: Sequence[Profiler], contention: ContentionProfiler | None = None) -> None:
        """Profile every model (in its own worker: with the threads it serves with) and their
        contention, then solve in the background."""
        t0 = time.perf_counter()
        sizes = sorted({1, 2, 4, self.cap})
        lats = []
        for name, profile in zip(self.names, profilers):
            lat = self.profiled[name] = await profile(sizes)
            fit = fit_latency(list(lat), list(lat.values()))
            if fit.c * self.cap < 0.05 * fit.a:  # a slope inside the noise only multiplies the chain's states
                fit = LatencyModel(fit(1), 0.0)
            lats.append(fit)
            log.info("model %s: decode step %s -> L(b) = %.2f ms + %.3f ms * b", name,
                     ", ".join(f"b={b}: {t * 1e3:.2f} ms" for b, t in lat.items()), fit.a * 1e3, fit.c * 1e3)
        t1 = time.perf_counter()
        try:
            samples = list(await contention(self.cap)) if contention is not None else []
        except ValueError as e:  # a KV pool too small for the profile's batches: tune without contention
            log.warning("contention not profiled (%s); the thresholds are solved without it", e)
            samples = []
        t2 = time.perf_counter()
        self.profile_seconds, self.contention_seconds = t1 - t0, t2 - t1
        con = Contention.from_samples(len(self.names), samples)
        self.contention = None if con.is_zero else con
        log.info("start-up profile: decode steps %.2fs, contention %.2fs (%s)", t1 - t0, t2 - t1,
                 "; ".join(f"{self.names[s.model]}@{s.batch} vs {self.names[s.other]}@{s.other_batch}: "
                           f"kappa {s.kappa:.2f}" for s in samples) or "none measured")
        self._task = asyncio.get_running_loop().create_task(self._solve_initial(lats))

    @property
    def solved(self) -> bool:
        """The start-up solve has ended (its table applied, or failed and left every threshold at 1)."""
        return self._task is not None and self._task.done()

    @property
    def resolving(self) -> bool:
        """A drift re-solve is running (one event-loop task at most; its solve runs in a worker thread)."""
        return self._resolving is not None

    def _build_tuner(self, lats: list[LatencyModel]) -> Tuner:
        """(thread) Pick delta from the state budget, then solve the schedule for N = 1..cap."""
        P, C = self.template
        # The quantum bounds the work: a fixed "40 quanta for the fastest step" let a slow model at
        # a large batch run to hundreds of quanta (minutes of solving); the budget does not.
        choice = choose_delta(P, lats, self.cap, contention=self.contention)
        coarse = choice.max_error > 0.05
        log.log(logging.WARNING if coarse else logging.INFO, "threshold tuning: %s%s", choice.describe(),
                "; the model is coarse for these latencies" if coarse else "")
        cfg = TunerConfig.build(P, C, lats, self.cap, delta=choice.delta, contention=self.contention,
                                table_states=DEFAULT_TABLE_STATES)
        return Tuner(cfg, should_stop=lambda: self._closing)

    async def _solve_initial(self, lats: list[LatencyModel]) -> None:
        t0 = time.perf_counter()
        try:
            self.tuner = await asyncio.to_thread(self._build_tuner, lats)
        except TuningCancelled:
            return
        except Exception as e:  # serving with B = 1 (eager) beats not serving
            log.exception("threshold tuning failed (%r); every threshold stays 1", e)
            return
        self.solve_seconds = time.perf_counter() - t0
        log.info("schedule solved in %.2fs (after %.2fs of profiling): %s", self.solve_seconds,
                 self.profile_seconds + self.contention_seconds, self.describe())
        self._apply()

    def describe(self, ns: Sequence[int] | None = None) -> str:
        ns = ns or sorted(n for n in {1, 2, 4, 8, 16, self.cap} if n <= self.cap)
        out = []
        for n in ns:
            s = self.tuner.schedule(n)
            what = f"delayed B={dict(zip(self.names, s.thresholds))}" if s.mode == "delayed" else s.mode
            out.append(f"N={n}: {what} ({s.predicted:.1f} tok/s predicted)")
        return ", ".join(out)

    def table(self) -> Table:
        return {n: self.tuner.thresholds(min(n, self.cap)) for n in range(1, self.max_concurrency + 1)}

    def modes(self) -> Modes:
        return {n: self.tuner.schedule(min(n, self.cap)).mode for n in range(1, self.max_concurrency + 1)}

    def _apply(self) -> None:
        self.apply(self.table(), self.modes())

    def observe(self, src: int, dst: int, tokens: int, count: int = 1) -> None:
        """`count` decisions src -> dst that committed `tokens` in all: feed the online estimate of P;
        re-solve off the loop every `resolve_every` decisions if it drifted."""
        if self.tuner is None:
            return
        self.tuner.observe(src, dst, tokens, count)
        self._decisions += count
        every = self.resolve_every
        if every is not None and self._decisions // every != (self._decisions - count) // every \
                and self._resolving is None and not self._closing:
            self._resolving = asyncio.get_running_loop().create_task(self._resolve())

    def observe_step(self, model: int, span: StepSpan, seconds: float, hop: float = 0.0) -> None:
        """One step of `model`: its forward's `span` in the worker, and `seconds` of the event loop's
        own work around it (scheduling before the hop to the worker; finishing, routing and
        committing after it; handling the messages that made it ready). The start-up profile
        times the step and the hop; the loop's work is the rest of what a model's step costs in
        the runtime (`step_costs`), and the spans say what the forwards cost while serving, the
        models overlapping as they did (`served`). `hop`: seconds of the hop to the worker and
        back, which the start-up profile's step includes and the span does not."""
        self._steps[model].append((span.batch, seconds))
        self._spans[model].append(span)
        self._hops[model].append(hop)

    def step_costs(self) -> list[LatencyModel] | None:
        """Per model, the loop's work per step as L(b) = a + c * b over the recent steps; None until
        every model has stepped MIN_STEP_SAMPLES times."""
        if any(len(d) < MIN_STEP_SAMPLES for d in self._steps):
            return None
        return [fit_samples([b for b, _ in d], [t for _, t in d]) for d in (list(d) for d in self._steps)]

    def served(self) -> ServedFit | None:
        """The profiled step costs scaled, and kappa refitted, on the recent served forwards
        (`aiorouter.tuning.learned`); None until every model has MIN_SPANS of them."""
        if self.tuner is None or any(len(d) < MIN_SPANS for d in self._spans):
            return None
        return fit_served([list(d) for d in self._spans], self.tuner.config.latency, fixed=self._mean_hops(),
                          prior=self.contention)

    def _mean_hops(self) -> list[float]:
        return [sum(d) / len(d) if d else 0.0 for d in self._hops]

    def _resolve_blocking(self, step_costs: list[LatencyModel] | None, spans: list[list[StepSpan]] | None,
                          hops: list[float]) -> tuple[bool, bool]:
        """(thread) -> (a re-solve ran, it changed the schedule at some N)."""
        before = self.tuner.table
        served = (fit_served(spans, self.tuner.config.latency, fixed=hops, prior=self.contention)
                  if spans is not None else None)
        changed = self.tuner.maybe_resolve(step_costs, served, runner=self._background.run)
        return self.tuner.table is not before, changed

    async def _resolve(self) -> None:
        try:
            t0 = time.perf_counter()
            # the step samples and spans are read here, on the loop that appends them
            spans = None if any(len(d) < MIN_SPANS for d in self._spans) else [list(d) for d in self._spans]
            ran, changed = await asyncio.to_thread(self._resolve_blocking, self.step_costs(), spans,
                                                   self._mean_hops())
            if ran:
                self.resolves += 1
                log.info("routing or step times moved: re-solved in %.2fs%s", time.perf_counter() - t0,
                         f"; now {self.describe()}" if changed else "; the schedule stays (gain within the noise)")
            if changed and not self._closing:
                self.swaps += 1
                self._apply()
        except TuningCancelled:
            pass
        except Exception as e:  # a failed re-solve keeps the current schedule
            log.warning("threshold re-solve failed: %r", e)
        finally:
            self._resolving = None

    async def wait(self) -> None:
        """Until the start-up solve is done."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def wait_resolved(self) -> None:
        """Until a re-solve in progress (if any) is done."""
        if self._resolving is not None:
            await asyncio.shield(self._resolving)

    async def close(self) -> None:
        self._closing = True
        self._background.cancel()  # a re-solve's child ends now, not when its solve would
        for t in (self._task, self._resolving):
            if t is not None:
                t.cancel()
        await asyncio.gather(*(t for t in (self._task, self._resolving) if t is not None), return_exceptions=True)
