"""The Tuner: per concurrency N, the schedule to run, and when to re-solve it.

It solves the threshold table (every feasible B, every N up to the cap) with the contention the
models were measured to have, predicts step-sync beside it, and names per N the best of delayed
(B*), eager and sync (`schedules.choose_schedule`).  When the routing drifts from the P it was
solved for (`learned.routing_drift`), or the runtime's own work per step (`step_cost`: the event
loop's scheduling, routing and commits around each step, measured while serving) moves a model's
step time by more than `cost_margin`, or the served forwards (`served`: each model's step cost
scaled, and kappa refitted, from the spans it served; `learned.fit_served`) move a step time by more than
`cost_margin` or a kappa by more than `contention_margin`, `propose` solves again for what it observed
(re-choosing the quantum from the state budget when configured) and keeps, per N, the current
choice unless the new one is predicted to beat it, under the new inputs, by more than `min_gain`.
`adopt` swaps it in.
These are plain calls; when to make them (in a background thread, how often) is the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
import logging
import threading
import time
from typing import Callable, Sequence

import numpy as np

from .dtmc import DEFAULT_MAX_STATES, choose_delta
from .inputs import Contention, DEFAULT_DELTA, LatencyLike, LatencyModel, SystemSpec, check_concurrency
from .learned import RoutingDrift, RoutingEstimator, ServedFit, TuningCancelled, routing_drift
from .schedules import DELAYED_MARGIN, Schedule, SyncResult, choose_schedule, sync_throughput
from .search import SearchResult, SolveCache, ThresholdTable, threshold_table
from .solve import SolverError
from .statespace import StateLimitError

log = logging.getLogger("aiorouter.tuning")


@dataclass(frozen=True)
class TunerConfig:
    """What the router knows at start: the models, the template routing, their contention."""

    P: tuple[tuple[float, ...], ...]
    C: tuple[tuple[float, ...], ...]
    latency: tuple[LatencyModel, ...]
    max_concurrency: int
    delta: float = DEFAULT_DELTA
    drift_margin: float = 0.05  # an entry of P must move by more than this ...
    drift_z: float = 3.0  # ... and by more than this many standard errors to count as drift
    drift_min_row: int = 50  # decisions a row needs before it is tested
    prior_strength: float = 200.0
    min_new_observations: int = 500  # decisions between two re-solves
    max_states: int = DEFAULT_MAX_STATES
    workers: int = 1
    contention: Contention | None = None
    table_states: int | None = None  # re-choose delta from this state budget when re-solving
    # A re-solve swaps the schedule at N only when it predicts more than this gain: measured
    # throughput of one schedule moves by ~3 % between runs on the bench machine.
    min_gain: float = 0.03
    sync_margin: float = 0.0  # sync must beat delayed by more than this to be chosen
    delayed_margin: float = DELAYED_MARGIN  # ... and delayed B* (not all ones) the better of eager and sync
    # A step cost that moves a model's L(1) or L(cap) by more than this share calls for a re-solve
    cost_margin: float = 0.02
    # ... and a kappa that moves by more than this (kappa from served steps; learned.fit_served)
    contention_margin: float = 0.05

    @classmethod
    def build(cls, P: object, C: object, latency: Sequence[LatencyLike], max_concurrency: int,
              **kw: object) -> "TunerConfig":
        spec = SystemSpec.build(P, C, list(latency), kw.pop("delta", DEFAULT_DELTA),  # type: ignore[arg-type]
                               kw.pop("contention", None))  # type: ignore[arg-type]
        for name in ("min_gain", "sync_margin", "delayed_margin", "drift_margin", "drift_z", "cost_margin", "contention_margin"):
            if name in kw and not float(kw[name]) >= 0:  # type: ignore[arg-type]
                raise ValueError(f"TunerConfig.{name} must be >= 0, got {kw[name]!r}")
        return cls(P=spec.P, C=spec.C, latency=spec.latency, max_concurrency=check_concurrency(max_concurrency),
                   delta=spec.delta, contention=spec.contention, **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Solved:
    """One solve: the inputs, every N's threshold search, and the schedule per N."""

    P: np.ndarray
    C: np.ndarray
    delta: float
    latency: tuple[LatencyModel, ...]  # what each model's step cost in the chain (profile + step cost)
    table: ThresholdTable
    schedules: dict[int, Schedule]
    contention: Contention | None = None  # what the models cost each other in the chain


@dataclass(frozen=True)
class Proposal:
    """A re-solve after drift.  `changed`: the N whose schedule it swaps (empty: the predicted
    gains stayed within `min_gain`; adopting it still moves the reference P and step times)."""

    drift: RoutingDrift
    cost_moved: bool  # the step times moved (with or without routing drift)
    solved: Solved
    gains: dict[int, float]  # per N: new choice over the current one, both under the new P, minus 1
    changed: tuple[int, ...]
    # what it was solved with beyond the profile (the arguments of propose): the loop's work per
    # step and the served refit; Solved.latency is with_step_cost(step_cost, served) when set
    step_cost: tuple[LatencyModel, ...] | None = None
    served: ServedFit | None = None


Runner = Callable[..., list]  # runner(fn, *args) -> fn(*args), run wherever it runs


def solve_rows(spec: SystemSpec, max_concurrency: int, max_states: int, workers: int,
               cache: SolveCache | None = None, should_stop: Callable[[], bool] | None = None
               ) -> list[tuple[SearchResult, SyncResult, str | None]]:
    """Per N = 1..max_concurrency: (its threshold search, step-sync's throughput, why the search
    failed or None). A module-level function of plain data, so that a child process can run it."""
    out: list[tuple[SearchResult, SyncResult, str | None]] = []
    for n in range(1, max_concurrency + 1):
        if should_stop is not None and should_stop():
            raise TuningCancelled(f"stopped before N = {n}")
        failure = None
        try:
            row = threshold_table(spec, n, min_concurrency=n, max_states=max_states, cache=cache, workers=workers).rows[0]
        except (StateLimitError, SolverError) as e:
            # One N failing must not cost the others: keep N - 1's B* (feasible at N too), or all
            # ones at N = 1.
            prev = out[-1][0].best if out else (1,) * spec.M
            row, failure = SearchResult(n, prev, float("nan"), (), 0.0), str(e)
        out.append((row, sync_throughput(spec, n), failure))
    return out


class NoQuantumFits(ValueError):
    """No time quantum keeps the threshold table within its state budget."""


def requantized_rows(P: np.ndarray, C: np.ndarray, latency: Sequence[LatencyModel], contention: Contention | None,
                     table_states: int, max_concurrency: int, max_states: int, workers: int
                     ) -> tuple[float, list[tuple[SearchResult, SyncResult, str | None]]]:
    """The quantum whose table fits `table_states` (`choose_delta`), then `solve_rows` at it ->
    (delta, rows). One job, so that a re-solve's child does both: choosing the quantum counts the
    chains' states in Python, 0.6 s of the serving process's GIL at N = 16 (cpu-tiny) when it ran
    there, in a 12 s benchmark run."""
    try:
        delta = choose_delta(P, list(latency), max_concurrency, table_states=table_states, max_states=max_states,
                             contention=contention).delta
    except ValueError as e:
        raise NoQuantumFits(str(e)) from e
    spec = SystemSpec.build(P, C, list(latency), delta, contention)
    return delta, solve_rows(spec, max_concurrency, max_states, workers)


@dataclass
class Tuner:
    """Holds the per-N schedules; re-solves them when the routing drifts."""

    config: TunerConfig
    cache: SolveCache = field(default_factory=SolveCache)
    # Polled between concurrency levels: a router that closes mid-solve stops its thread.
    should_stop: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        cfg = self.config
        self.estimator = RoutingEstimator(cfg.P, cfg.C, cfg.prior_strength)
        self._lock = threading.Lock()
        self._mark = self.estimator.totals()
        self.last: Proposal | None = None  # the last proposal adopted (why it re-solved, what it changed)
        self._solved = self.solve(np.array(cfg.P), np.array(cfg.C), cfg.delta, "start", cfg.latency)

    # -- what to run ---------------------------------------------------------------------------
    @property
    def table(self) -> ThresholdTable:
        return self._solved.table

    @property
    def solved_P(self) -> np.ndarray:
        return self._solved.P.copy()

    @property
    def delta(self) -> float:
        return self._solved.delta

    @property
    def latency(self) -> tuple[LatencyModel, ...]:
        """The step times the current schedule was solved with (the profile, plus any step cost)."""
        return self._solved.latency

    def schedule(self, N: int) -> Schedule:
        """The schedule for N requests in flight (N above the cap uses the cap's)."""
        return self._solved.schedules[min(check_concurrency(N), self.config.max_concurrency)]

    def thresholds(self, N: int) -> tuple[int, ...]:
        """Delayed-batching thresholds for N: the schedule's B, or B* where the schedule is sync."""
        s = self.schedule(N)
        return s.thresholds if s.mode != "sync" else s.best_thresholds

    def observe(self, src: int, dst: int, tokens: float | None = None, count: int = 1) -> None:
        self.estimator.observe(src, dst, tokens, count)

    # -- solving -------------------------------------------------------------------------------
    @property
    def contention(self) -> Contention | None:
        """The contention the current schedule was solved with (the profile's, or served steps')."""
        return self._solved.contention

    def spec(self, P: np.ndarray, C: np.ndarray, delta: float, latency: Sequence[LatencyModel] | None = None,
             contention: Contention | None = None) -> SystemSpec:
        return SystemSpec.build(P, C, list(latency or self.config.latency), delta,
                               self.config.contention if contention is None else contention)

    def solve(self, P: np.ndarray, C: np.ndarray, delta: float | None, why: str,
              latency: Sequence[LatencyModel] | None = None, contention: Contention | None = None,
              runner: Runner | None = None) -> Solved:
        """Threshold table and schedules for N = 1..cap (blocking; seconds). `delta`: the quantum,
        or None to choose the one that fits the table's state budget (`requantized_rows`; raises
        NoQuantumFits). `latency` and `contention`: the step times and contention to solve with
        (default: the profiled ones). `runner`: where the work is done, as runner(fn, *args) (a
        re-solve while serving: `service.BackgroundSolver.run`, a child process); None: here."""
        cfg = self.config
        latency = list(latency or cfg.latency)
        contention = cfg.contention if contention is None else contention
        t0 = time.perf_counter()
        # (a child has a cache of its own, is cancelled by ending it, not polled, and solves in
        # one process)
        if delta is None:
            args = (np.asarray(P, dtype=float), np.asarray(C, dtype=float), latency, contention,
                    cfg.table_states, cfg.max_concurrency, cfg.max_states)
            delta, rows = requantized_rows(*args, cfg.workers) if runner is None else runner(requantized_rows, *args, 1)
            spec = self.spec(P, C, delta, latency, contention)
        else:
            spec = self.spec(P, C, delta, latency, contention)
            rows = (solve_rows(spec, cfg.max_concurrency, cfg.max_states, cfg.workers, self.cache, self.should_stop)
                    if runner is None else runner(solve_rows, spec, cfg.max_concurrency, cfg.max_states, 1))
        schedules = {}
        for row, sync, failure in rows:
            if failure is not None:
                log.warning("B* (%s) N=%d: solve failed (%s); using N=%d's B=%s", why, row.N, failure, row.N - 1, row.best)
            schedules[row.N] = choose_schedule(row, sync, cfg.sync_margin, cfg.delayed_margin)
        table = ThresholdTable(tuple(r for r, _, _ in rows), time.perf_counter() - t0)
        for row in table.rows:
            s = schedules[row.N]
            log.info("B* (%s) N=%d: B=%s predicted %.1f tokens/s (eager %.1f, sync %.1f): run %s",
                     why, row.N, row.best, row.best_throughput, s.eager, s.sync, s.choice)
        log.info("threshold table for N=1..%d solved in %.2fs%s", cfg.max_concurrency, table.seconds,
                 "" if runner is None else " (in the background)")
        return Solved(np.array(P, dtype=float), np.array(C, dtype=float), float(delta), spec.latency, table, schedules,
                      cfg.contention if contention is None else contention)

    def with_step_cost(self, step_cost: Sequence[LatencyModel],
                       served: ServedFit | None = None) -> tuple[LatencyModel, ...]:
        """Each model's profiled step time (scaled to what it served, with `served`) plus the
        runtime's own work per step (`step_cost`)."""
        base = self.config.latency if served is None else tuple(served.latencies(self.config.latency))
        if len(step_cost) != len(base) or (served is not None and len(served.scales) != len(base)):
            raise ValueError(f"step_cost has {len(step_cost)} models, the tuner {len(base)}")
        return tuple(lat + cost for lat, cost in zip(base, step_cost))

    def _contention_moved(self, new: Contention | None) -> bool:
        """Does any kappa, at any pair of batch sizes up to the cap, differ from the solved one by
        more than `contention_margin`?"""
        cap, M = self.config.max_concurrency, len(self.config.latency)
        old = self._solved.contention
        tab = [c.table(cap) if c is not None else np.zeros((M, M, cap + 1, cap + 1)) for c in (new, old)]
        return float(np.abs(tab[0] - tab[1]).max()) > self.config.contention_margin

    def _cost_moved(self, latency: Sequence[LatencyModel]) -> bool:
        """Does any model's step time at batch 1 or at the cap differ from the solved one by more than
        `cost_margin`?"""
        cap = self.config.max_concurrency
        return any(abs(new(b) - old(b)) > self.config.cost_margin * old(b)
                   for new, old in zip(latency, self._solved.latency) for b in (1, cap))

    def propose(self, counts: np.ndarray | None = None, tokens: np.ndarray | None = None,
                step_cost: Sequence[LatencyModel] | None = None, served: ServedFit | None = None,
                runner: Runner | None = None) -> Proposal | None:
        """Re-solve if the routing drifted or the step times moved; None if neither did (or no quantum
        fits the budget).

        `counts` (M x M decisions i -> j) and `tokens` (tokens they committed) default to the
        estimator's decisions since the last solve.  `step_cost`: per model, the runtime's work
        around each step as measured while serving (None: keep the step times solved with).
        `served`: the profile's step costs scaled and kappa refitted on served forwards (None: keep
        the step times and contention solved with). `runner`: where the table is solved (`solve`).
        Blocking (a full solve, seconds)."""
        cfg = self.config
        if counts is None:
            now = self.estimator.totals()
            counts, tokens = now[0] - self._mark[0], now[1] - self._mark[1]
        counts = np.asarray(counts, dtype=float)
        cur = self._solved
        drift = routing_drift(cur.P, counts, margin=cfg.drift_margin, z=cfg.drift_z, min_row=cfg.drift_min_row)
        if step_cost is not None:
            latency = self.with_step_cost(step_cost, served)
        else:  # no loop work measured: the profile, scaled to what was served
            latency = cur.latency if served is None else tuple(served.latencies(self.config.latency))
        # (a zero Contention, unlike None, means "measured: none")
        contention = cur.contention if served is None else served.contention()
        cost_moved = self._cost_moved(latency) or self._contention_moved(contention)
        if not drift.drifted and not cost_moved:
            return None
        P, C = (drift.observed_P, cur.C.copy()) if drift.drifted else (cur.P, cur.C)
        if drift.drifted and tokens is not None:
            ok = counts >= cfg.drift_min_row
            C[ok] = np.asarray(tokens, dtype=float)[ok] / counts[ok]
        if drift.drifted:
            log.info("routing drifted (P[%d][%d] moved %.3f, %.1f standard errors, %d decisions); re-solving",
                     *(drift.entry or (0, 0)), drift.moved, drift.z_score, drift.decisions)
        if cost_moved:
            log.info("step times or contention moved while serving (L(1): %s ms%s); re-solving",
                     ", ".join(f"{o(1) * 1e3:.2f} -> {n(1) * 1e3:.2f}" for o, n in zip(cur.latency, latency)),
                     "" if served is None else f"; served kappa {[[round(k, 2) for k in r] for r in served.kappa]}")
        try:  # (the quantum is chosen anew for the new step times, with the table: `requantized_rows`)
            new = self.solve(P, C, None if cfg.table_states is not None else cur.delta, "re-solve", latency,
                             contention, runner)
        except NoQuantumFits as e:
            log.warning("routing or step times moved but no quantum fits the state budget (%s); keeping B", e)
            return None
        schedules, gains, changed = {}, {}, []
        for N, ns in new.schedules.items():
            old = cur.schedules[N]
            row = new.table[N]
            if not row.candidates:  # this N failed: keep what runs
                schedules[N] = old
                continue
            old_now = ns.predicted_for(old.mode, old.thresholds, row)
            gains[N] = ns.predicted / old_now - 1.0
            if ns.choice != old.choice and gains[N] > cfg.min_gain:
                schedules[N] = ns
                changed.append(N)
            else:
                schedules[N] = replace(ns, mode=old.mode, thresholds=old.thresholds, predicted=old_now)
        return Proposal(drift, cost_moved, replace(new, schedules=schedules), gains, tuple(changed),
                        None if step_cost is None else tuple(step_cost), served)

    def adopt(self, proposal: Proposal) -> None:
        """Make a proposal current; later drift is measured from its P and from now on."""
        with self._lock:
            self._solved = proposal.solved
            self._mark = self.estimator.totals()
            self.last = proposal

    def maybe_resolve(self, step_cost: Sequence[LatencyModel] | None = None, served: ServedFit | None = None,
                      runner: Runner | None = None) -> bool:
        """propose() on the decisions since the last solve (once there are enough), on the
        measured `step_cost` and on the `served` refit, and adopt it. True when some N's schedule changed."""
        with self._lock:
            now = self.estimator.totals()
            if now[0].sum() - self._mark[0].sum() < self.config.min_new_observations:
                return False
        p = self.propose(step_cost=step_cost, served=served, runner=runner)
        if p is None:
            return False
        self.adopt(p)
        return bool(p.changed)
