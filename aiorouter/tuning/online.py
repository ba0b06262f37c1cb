"""Online re-estimation of P (and C), and the Tuner: per concurrency, the schedule to run.

The paper solves B once from an offline P.  Routing behaviour depends on the
workload, so the router feeds every routing decision it takes into a
RoutingEstimator; the Tuner (tuner.py) solves the threshold table and the
per-N schedule, and re-solves when the routing drifts (drift.py).
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from .spec import check_routing_matrix


class TuningCancelled(Exception):
    """The Tuner's should_stop() said so mid-solve."""


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

    def totals(self) -> tuple[np.ndarray, np.ndarray]:
        """(decisions i -> j, tokens committed by them), copies taken together: a caller can
        difference two snapshots to test only recent decisions."""
        with self._lock:
            return self._counts.copy(), self._tokens.copy()

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


