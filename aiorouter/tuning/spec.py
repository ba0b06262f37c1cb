"""Validated inputs of the throughput model (docs/throughput-model.md).

Everything that can be wrong with user input is checked here, once, with a
ValueError that names the offending row / model / threshold, so the solver
and simulator can assume clean inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce
from typing import Sequence

import numpy as np

from .contention import Contention
from .latency import LatencyLike, LatencyModel, as_latency_model

DEFAULT_DELTA = 1e-4  # 0.1 ms, the paper's quantum
ROW_SUM_TOL = 1e-6

Matrix = tuple[tuple[float, ...], ...]


def _as_matrix(name: str, x: object) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a numeric M x M matrix, got {x!r}") from None
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] < 1:
        raise ValueError(f"{name} must be a square M x M matrix, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains non-finite entries")
    return a


def check_routing_matrix(P: object) -> np.ndarray:
    """P must be square, entries in [0, 1], every row summing to 1."""
    a = _as_matrix("P", P)
    bad = np.argwhere((a < 0) | (a > 1))
    if bad.size:
        i, j = bad[0]
        raise ValueError(f"P[{i}][{j}] = {a[i, j]!r} is not a probability in [0, 1]")
    sums = a.sum(axis=1)
    for i, s in enumerate(sums):
        if abs(s - 1.0) > ROW_SUM_TOL:
            raise ValueError(f"row {i} of P sums to {s:.6g}, not 1")
    # Renormalise the tiny rounding error we tolerated.
    return a / sums[:, None]


@dataclass(frozen=True)
class ModelSpec:
    """The routing system: P, C, per-model latency, the time quantum, and how the models slow
    each other when they step at once (None: each as if on hardware of its own)."""

    P: Matrix
    C: Matrix
    latency: tuple[LatencyModel, ...]
    delta: float = DEFAULT_DELTA
    contention: Contention | None = None

    @classmethod
    def build(
        cls,
        P: object,
        C: object,
        latency: Sequence[LatencyLike],
        delta: float = DEFAULT_DELTA,
        contention: Contention | None = None,
    ) -> "ModelSpec":
        """Validate raw inputs (nested lists / arrays / seconds) into a spec.

        A contention model that is zero everywhere is stored as None: the chain is then exactly
        the one without contention (same states, same solve)."""
        p = check_routing_matrix(P)
        c = _as_matrix("C", C)
        M = p.shape[0]
        if c.shape != p.shape:
            raise ValueError(f"C has shape {c.shape} but P has shape {p.shape}; both must be M x M")
        if np.any(c < 0):
            i, j = np.argwhere(c < 0)[0]
            raise ValueError(f"C[{i}][{j}] = {c[i, j]!r}: committed tokens must be non-negative")
        lat = list(latency) if not isinstance(latency, (int, float, LatencyModel)) else [latency]
        if len(lat) != M:
            raise ValueError(f"got {len(lat)} latencies for M = {M} models; shapes must match")
        models = tuple(as_latency_model(x, i) for i, x in enumerate(lat))
        if not (isinstance(delta, (int, float)) and math.isfinite(delta) and delta > 0):
            raise ValueError(f"delta must be a positive number of seconds, got {delta!r}")
        if contention is not None:
            if not isinstance(contention, Contention):
                raise ValueError(f"contention must be a Contention (aiorouter.tuning), got {contention!r}")
            if contention.M != M:
                raise ValueError(f"contention is for {contention.M} models but P has M = {M}")
            if contention.is_zero:
                contention = None
        return cls(
            P=tuple(tuple(float(v) for v in row) for row in p),
            C=tuple(tuple(float(v) for v in row) for row in c),
            latency=models,
            delta=float(delta),
            contention=contention,
        )

    @property
    def M(self) -> int:
        return len(self.P)

    def p_array(self) -> np.ndarray:
        return np.array(self.P, dtype=float)

    def c_array(self) -> np.ndarray:
        return np.array(self.C, dtype=float)

    def tokens_per_step(self) -> np.ndarray:
        """gamma_i = sum_j c_ij p_ij: expected tokens committed per request-step on i."""
        return (self.p_array() * self.c_array()).sum(axis=1)

    def with_contention(self, contention: Contention | None) -> "ModelSpec":
        return ModelSpec.build(self.P, self.C, self.latency, self.delta, contention)

    def with_routing(self, P: object, C: object | None = None) -> "ModelSpec":
        return ModelSpec.build(P, self.C if C is None else C, self.latency, self.delta, self.contention)

    def kappa_table(self, N: int) -> np.ndarray | None:
        """K[i, j, b_i, b_j] (contention.Contention.table), or None without contention."""
        return None if self.contention is None else self.contention.table(N)

    def quanta_table(self, N: int) -> np.ndarray:
        """d[i, b] = residual quanta of a batch of b on model i (d[i, 0] = 0)."""
        d = np.zeros((self.M, N + 1), dtype=np.int64)
        for i, lm in enumerate(self.latency):
            for b in range(1, N + 1):
                d[i, b] = lm.quanta(b, self.delta)
        return d


def quanta_unit(d: np.ndarray, contended: bool = False) -> int:
    """gcd of all batch durations (1 with contention).

    Every residual ever reached is an integer combination of durations, so
    measuring time in units of this gcd relabels the chain exactly (same
    states, same transitions) while shrinking the packed-key space.  Contention
    charges arbitrary fractions of a step (`contention.overlap`), so residuals
    are then kept in quanta: delta alone sets the resolution.
    """
    if contended:
        return 1
    vals = [int(v) for v in d[:, 1:].ravel()]
    return reduce(math.gcd, vals) if vals else 1


def check_concurrency(N: object) -> int:
    if isinstance(N, bool) or not isinstance(N, (int, np.integer)):
        raise ValueError(f"N (concurrency) must be an integer >= 1, got {N!r}")
    if N < 1:
        raise ValueError(f"N (concurrency) must be >= 1, got {N}")
    return int(N)


def is_feasible(B: Sequence[int], N: int) -> bool:
    """No deadlock: sum_i (B_i - 1) < N and 1 <= B_i <= N."""
    return all(1 <= b <= N for b in B) and sum(b - 1 for b in B) < N


def check_thresholds(B: object, M: int, N: int) -> tuple[int, ...]:
    try:
        t = tuple(int(b) for b in B)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"thresholds B must be a sequence of {M} integers, got {B!r}") from None
    if len(t) != M:
        raise ValueError(f"thresholds B has {len(t)} entries but there are M = {M} models")
    for i, b in enumerate(t):
        if not 1 <= b <= N:
            raise ValueError(f"threshold B[{i}] = {b} is outside 1..N (N = {N})")
    if sum(b - 1 for b in t) >= N:
        raise ValueError(
            f"thresholds B = {t} are infeasible for N = {N}: the rule sum(B_i - 1) < N "
            f"is violated (sum(B_i - 1) = {sum(b - 1 for b in t)}); such B can deadlock"
        )
    return t
