"""Online re-estimation of P (and C) and re-solving of B* when it drifts.

The paper solves B once from an offline P.  Routing behaviour depends on the
workload, so the router feeds every routing decision it takes into a
RoutingEstimator; the Tuner re-solves the threshold table when the estimate
has moved by more than a margin from the P the table was solved for.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ._blocks import SolverError
from ._statespace import StateLimitError
from .dtmc import DEFAULT_MAX_STATES
from .latency import LatencyLike, LatencyModel, as_latency_model
from .search import SearchResult, SolveCache, ThresholdTable, threshold_table
from .spec import DEFAULT_DELTA, ModelSpec, check_concurrency, check_routing_matrix


class TuningCancelled(Exception):
    """The Tuner's should_stop() said so mid-solve."""


log = logging.getLogger("aiorouter.tuning")


class RoutingEstimator:
    """Counts routing decisions i -> j (and tokens committed by each move).

    The prior is `prior_strength` pseudo-decisions per row spread like the
    template P (each carrying the template's c_ij tokens), so the estimate
    starts at the template and moves towards the data as decisions arrive.
    """

    def __init__(self, template_P: object, template_C: object | None = None,
                 prior_strength: float = 100.0) -> None:
        P = check_routing_matrix(template_P)
        M = P.shape[0]
        C = np.ones((M, M)) if template_C is None else np.asarray(template_C, dtype=float)
        if C.shape != P.shape:
            raise ValueError(f"template C has shape {C.shape} but P has shape {P.shape}")
        if not prior_strength >= 0:
            raise ValueError(f"prior_strength must be >= 0, got {prior_strength!r}")
        self.M = M
        self._prior = prior_strength * P
        self._prior_tokens = self._prior * C
        self._template_C = C
        self._counts = np.zeros((M, M))
        self._tokens = np.zeros((M, M))
        self._lock = threading.Lock()

    def observe(self, src: int, dst: int, tokens: float | None = None, count: int = 1) -> None:
        """Record `count` decisions to move from model src to model dst."""
        if not (0 <= src < self.M and 0 <= dst < self.M):
            raise ValueError(f"routing decision {src} -> {dst} outside 0..{self.M - 1}")
        with self._lock:
            self._counts[src, dst] += count
            if tokens is not None:
                self._tokens[src, dst] += tokens
            else:
                self._tokens[src, dst] += count * self._template_C[src, dst]

    def observe_many(self, src: Sequence[int], dst: Sequence[int],
                     tokens: Sequence[float] | None = None) -> None:
        """Vectorised observe() for a whole batch of decisions."""
        s = np.asarray(src, dtype=np.int64)
        d = np.asarray(dst, dtype=np.int64)
        if s.shape != d.shape:
            raise ValueError("src and dst must have the same length")
        if s.size and (s.min() < 0 or d.min() < 0 or s.max() >= self.M or d.max() >= self.M):
            raise ValueError(f"routing decisions outside 0..{self.M - 1}")
        tk = self._template_C[s, d] if tokens is None else np.asarray(tokens, dtype=float)
        with self._lock:
            np.add.at(self._counts, (s, d), 1.0)
            np.add.at(self._tokens, (s, d), tk)

    @property
    def observations(self) -> int:
        return int(self._counts.sum())

    def counts(self) -> np.ndarray:
        with self._lock:
            return self._counts.copy()

    def estimate(self) -> np.ndarray:
        """Posterior-mean P; a row with neither prior nor data stays 'stay put'."""
        with self._lock:
            tot = self._prior + self._counts
        rows = tot.sum(axis=1, keepdims=True)
        P = np.divide(tot, rows, out=np.zeros_like(tot), where=rows > 0)
        empty = rows[:, 0] == 0
        P[empty, :] = 0.0
        P[empty, np.flatnonzero(empty)] = 1.0
        return P

    def estimate_C(self) -> np.ndarray:
        """Mean committed tokens per move i -> j (the template where unseen)."""
        with self._lock:
            n = self._prior + self._counts
            t = self._prior_tokens + self._tokens
        return np.where(n > 0, t / np.where(n > 0, n, 1.0), self._template_C)

    def max_drift(self, reference_P: object) -> float:
        ref = np.asarray(reference_P, dtype=float)
        if ref.shape != (self.M, self.M):
            raise ValueError(f"reference P has shape {ref.shape}, expected {(self.M, self.M)}")
        return float(np.abs(self.estimate() - ref).max())

    def drifted(self, reference_P: object, margin: float) -> bool:
        """True when some entry of the estimate differs from reference_P by > margin."""
        if not margin >= 0:
            raise ValueError(f"margin must be >= 0, got {margin!r}")
        return self.max_drift(reference_P) > margin


@dataclass(frozen=True)
class TunerConfig:
    """What the router knows at start: the models and the template routing."""

    P: tuple[tuple[float, ...], ...]
    C: tuple[tuple[float, ...], ...]
    latency: tuple[LatencyModel, ...]
    max_concurrency: int
    delta: float = DEFAULT_DELTA
    drift_margin: float = 0.05  # re-solve when some p_ij moved by more than this
    prior_strength: float = 200.0
    min_new_observations: int = 500  # decisions between two re-solves
    max_states: int = DEFAULT_MAX_STATES
    workers: int = 1

    @classmethod
    def build(cls, P: object, C: object, latency: Sequence[LatencyLike], max_concurrency: int,
              **kw: object) -> "TunerConfig":
        spec = ModelSpec.build(P, C, list(latency), kw.pop("delta", DEFAULT_DELTA))  # type: ignore[arg-type]
        return cls(P=spec.P, C=spec.C, latency=spec.latency,
                   max_concurrency=check_concurrency(max_concurrency), delta=spec.delta,
                   **kw)  # type: ignore[arg-type]


@dataclass
class Tuner:
    """Holds the B* table and re-solves it when the routing estimate drifts."""

    config: TunerConfig
    cache: SolveCache = field(default_factory=SolveCache)
    # Polled between concurrency levels: a router that closes mid-solve stops its thread.
    should_stop: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        cfg = self.config
        self.estimator = RoutingEstimator(cfg.P, cfg.C, cfg.prior_strength)
        self._solved_P = np.array(cfg.P)
        self._solved_at = 0
        self._lock = threading.Lock()
        self.table: ThresholdTable = self._solve(np.array(cfg.P), np.array(cfg.C), "start")

    def _solve(self, P: np.ndarray, C: np.ndarray, why: str) -> ThresholdTable:
        cfg = self.config
        lat = [as_latency_model(x) for x in cfg.latency]
        spec = ModelSpec.build(P, C, lat, cfg.delta)
        t0, rows = time.perf_counter(), []
        for n in range(1, cfg.max_concurrency + 1):
            if self.should_stop is not None and self.should_stop():
                raise TuningCancelled(f"stopped before N = {n}")
            try:
                rows += threshold_table(spec, n, min_concurrency=n, max_states=cfg.max_states,
                                        cache=self.cache, workers=cfg.workers).rows
            except (StateLimitError, SolverError) as e:
                # One N failing must not cost the others: keep N - 1's B*
                # (feasible at N too), or all ones at N = 1.
                prev = rows[-1].best if rows else (1,) * spec.M
                log.warning("B* (%s) N=%d: solve failed (%s); using N=%d's B=%s", why, n, e,
                            n - 1, prev)
                rows.append(SearchResult(n, prev, float("nan"), (), 0.0))
        table = ThresholdTable(tuple(rows), time.perf_counter() - t0)
        for row in table.rows:
            log.info("B* (%s) N=%d: B=%s predicted %.1f tokens/s",
                     why, row.N, row.best, row.best_throughput)
        log.info("threshold table for N=1..%d solved in %.2fs", cfg.max_concurrency, table.seconds)
        self._solved_P = P
        self._solved_at = self.estimator.observations
        return table

    @property
    def solved_P(self) -> np.ndarray:
        return self._solved_P.copy()

    def thresholds(self, N: int) -> tuple[int, ...]:
        """B* for N requests in flight (N above the table uses its last row)."""
        N = check_concurrency(N)
        return self.table.best(min(N, self.config.max_concurrency))

    def observe(self, src: int, dst: int, tokens: float | None = None) -> None:
        self.estimator.observe(src, dst, tokens)

    def maybe_resolve(self) -> bool:
        """Re-solve if P drifted past the margin (and enough new data arrived)."""
        with self._lock:
            new = self.estimator.observations - self._solved_at
            if new < self.config.min_new_observations:
                return False
            drift = self.estimator.max_drift(self._solved_P)
            if drift <= self.config.drift_margin:
                return False
            log.info("routing estimate drifted by %.3f (> %.3f) after %d decisions; re-solving",
                     drift, self.config.drift_margin, new)
            self.table = self._solve(self.estimator.estimate(), self.estimator.estimate_C(),
                                     "re-solve")
            return True
