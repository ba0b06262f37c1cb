"""The tuner's lifecycle inside a running router: profile each model, solve the threshold table in
the background (the router serves with B = 1 meanwhile), feed it the routes actually taken, and
re-solve off the event loop when they drift from what the table was solved for.

It sees models only through profiling callables and hands thresholds to a setter, so it stays free
of torch and of the router's internals.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Sequence

import numpy as np

from .latency import LatencyModel, fit_latency
from .online import TuningCancelled
from .tuner import Tuner, TunerConfig
from .quantum import choose_delta

log = logging.getLogger("aiorouter")

Profiler = Callable[[list[int]], Awaitable[dict[int, float]]]  # batch sizes -> seconds per decode step
Table = dict[int, tuple[int, ...]]  # concurrency N -> B per model

RESOLVE_EVERY = 2000  # routing decisions between drift checks


class TuningService:
    def __init__(self, names: Sequence[str], template: tuple[np.ndarray, np.ndarray], max_concurrency: int,
                 tune_concurrency: int | None, apply: Callable[[Table], None]):
        self.names, self.template, self.max_concurrency, self.apply = list(names), template, max_concurrency, apply
        self.cap = tune_concurrency or min(max_concurrency, 16 if len(self.names) == 2 else 8)
        self.tuner: Tuner | None = None
        self._closing = False
        self._task: asyncio.Task | None = None
        self._resolving: asyncio.Task | None = None
        self._decisions = 0

    async def start(self, profilers: Sequence[Profiler]) -> None:
        """Profile every model (in its own worker: with the threads it serves with), then solve in the background."""
        sizes = sorted({1, 2, 4, self.cap})
        lats = []
        for name, profile in zip(self.names, profilers):
            lat = await profile(sizes)
            fit = fit_latency(list(lat), list(lat.values()))
            if fit.c * self.cap < 0.05 * fit.a:  # a slope inside the noise only multiplies the chain's states
                fit = LatencyModel(fit(1), 0.0)
            lats.append(fit)
            log.info("model %s: decode step %s -> L(b) = %.2f ms + %.3f ms * b", name,
                     ", ".join(f"b={b}: {t * 1e3:.2f} ms" for b, t in lat.items()), fit.a * 1e3, fit.c * 1e3)
        self._task = asyncio.get_running_loop().create_task(self._solve_initial(lats))

    def _build_tuner(self, lats: list[LatencyModel]) -> Tuner:
        """(thread) Pick delta from the state budget, then solve the table for N = 1..cap."""
        P, C = self.template
        # The quantum bounds the work: a fixed "40 quanta for the fastest step" let a slow model at
        # a large batch run to hundreds of quanta (minutes of solving); the budget does not.
        choice = choose_delta(P, lats, self.cap)
        coarse = choice.max_error > 0.05
        log.log(logging.WARNING if coarse else logging.INFO, "threshold tuning: %s%s", choice.describe(),
                "; the model is coarse for these latencies" if coarse else "")
        return Tuner(TunerConfig.build(P, C, lats, self.cap, delta=choice.delta), should_stop=lambda: self._closing)

    async def _solve_initial(self, lats: list[LatencyModel]) -> None:
        try:
            self.tuner = await asyncio.to_thread(self._build_tuner, lats)
        except TuningCancelled:
            return
        except Exception as e:  # serving with B = 1 (eager) beats not serving
            log.exception("threshold tuning failed (%r); every threshold stays 1", e)
            return
        table = self.table()
        log.info("delayed-batching thresholds: %s", ", ".join(
            f"N={n}: {dict(zip(self.names, table[n]))}" for n in sorted({1, 2, 4, 8, self.cap}) if n <= self.cap))
        self.apply(table)

    def table(self) -> Table:
        return {n: self.tuner.thresholds(min(n, self.cap)) for n in range(1, self.max_concurrency + 1)}

    def observe(self, src: int, dst: int, tokens: int) -> None:
        """Feed the online estimate of P; re-solve off the loop every RESOLVE_EVERY decisions if it drifted."""
        if self.tuner is None:
            return
        self.tuner.observe(src, dst, tokens)
        self._decisions += 1
        if self._decisions % RESOLVE_EVERY == 0 and self._resolving is None:
            self._resolving = asyncio.get_running_loop().create_task(self._resolve())

    async def _resolve(self) -> None:
        try:
            if await asyncio.to_thread(self.tuner.maybe_resolve):
                self.apply(self.table())
        except Exception as e:  # a failed re-solve keeps the current thresholds
            log.warning("threshold re-solve failed: %r", e)
        finally:
            self._resolving = None

    async def wait(self) -> None:
        """Until the start-up solve is done."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def close(self) -> None:
        self._closing = True
        for t in (self._task, self._resolving):
            if t is not None:
                t.cancel()
        await asyncio.gather(*(t for t in (self._task, self._resolving) if t is not None), return_exceptions=True)
