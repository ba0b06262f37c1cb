"""What the chain is built from: step-latency models and their fits, how co-located models slow
each other (contention), and the system spec (P, C, latencies, quantum) with its checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
import math
from typing import Iterable, Sequence, Union

import numpy as np
from scipy.optimize import nnls

# -------------------- latency --------------------
# Per-step latency of one model as a function of its batch size.
#
# The paper's model uses a constant step latency L_i.  Real decoders get slower
# as the batch grows, so we also accept L_i(b) = a + c * b (seconds), fitted
# from a start-up profile with :func:`fit_latency`.


@dataclass(frozen=True)
class LatencyModel:
    """Step latency L(b) = a + c * b seconds for a batch of b requests."""

    a: float
    c: float = 0.0

    def __post_init__(self) -> None:
        for name, v in (("a", self.a), ("c", self.c)):
            if not math.isfinite(v) or v < 0:
                raise ValueError(
                    f"LatencyModel.{name} must be a finite non-negative number of seconds, got {v!r}"
                )
        if self.a + self.c <= 0:
            raise ValueError("LatencyModel gives zero latency for a batch of 1 (a + c must be > 0)")

    def __call__(self, batch_size: int) -> float:
        return self.a + self.c * batch_size

    def __add__(self, other: "LatencyModel") -> "LatencyModel":
        """Two costs paid one after the other in every step (a model's step and the loop's work around it)."""
        return LatencyModel(self.a + other.a, self.c + other.c)

    def quanta(self, batch_size: int, delta: float) -> int:
        """Residual time of a batch launched with `batch_size`, in quanta (>= 1)."""
        return max(1, int(round(self(batch_size) / delta)))


LatencyLike = Union[float, int, LatencyModel]


def as_latency_model(x: LatencyLike, index: int | None = None) -> LatencyModel:
    """Accept a constant latency in seconds or a LatencyModel."""
    if isinstance(x, LatencyModel):
        return x
    where = f" of model {index}" if index is not None else ""
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"latency{where} must be seconds or a LatencyModel, got {x!r}") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"latency{where} must be non-negative, got {v!r} s")
    if v == 0:
        raise ValueError(f"latency{where} must be positive, got 0 s")
    return LatencyModel(a=v, c=0.0)


def fit_latency(batch_sizes: Sequence[float], seconds: Sequence[float]) -> LatencyModel:
    """Non-negative least-squares fit of L(b) = a + c*b to a profile (`scipy.optimize.nnls`)."""
    b = np.asarray(batch_sizes, dtype=float).ravel()
    y = np.asarray(seconds, dtype=float).ravel()
    if b.shape != y.shape:
        raise ValueError(
            f"fit_latency: batch_sizes and seconds differ in length ({b.size} vs {y.size})"
        )
    if b.size < 2 or np.unique(b).size < 2:
        raise ValueError(
            "fit_latency needs at least 2 points with distinct batch sizes "
            f"(got {b.size} points, {np.unique(b).size} distinct batch sizes)"
        )
    if not (np.all(np.isfinite(b)) and np.all(np.isfinite(y))):
        raise ValueError("fit_latency: batch_sizes and seconds must be finite")
    if np.any(y < 0) or np.any(b < 0):
        raise ValueError("fit_latency: batch sizes and latencies must be non-negative")
    (a, c), _ = nnls(np.column_stack([np.ones_like(b), b]), y)
    return LatencyModel(a=float(a), c=float(c))


def fit_samples(batch_sizes: Sequence[float], seconds: Sequence[float]) -> LatencyModel:
    """`fit_latency` over raw samples (one per step), or their mean where every sample has one batch
    size (a line needs two): the chain wants each step's mean cost, and least squares over the
    samples fits the means per batch size, each weighted by how often it occurred."""
    if len(seconds) == 0:
        raise ValueError("fit_samples needs at least one sample")
    if np.unique(np.asarray(batch_sizes, dtype=float)).size < 2:
        return LatencyModel(max(float(np.mean(seconds)), 1e-9), 0.0)  # (a cost of exactly 0 is no model)
    fit = fit_latency(batch_sizes, seconds)
    return fit if fit.a + fit.c > 0 else LatencyModel(1e-9, 0.0)


@dataclass(frozen=True)
class StepCost:
    """Step time a + per_seq * b + per_token * T for b sequences computing T tokens in all.

    A routed model computes more than one token per request-step (catch-up extends after a
    handoff, prompts on a first visit): with tau tokens per request-step on average, its
    step at batch b takes `latency(tau)(b)`.
    """

    a: float
    per_seq: float
    per_token: float

    def __post_init__(self) -> None:
        for name in ("a", "per_seq", "per_token"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"StepCost.{name} must be a finite non-negative number of seconds, got {v!r}")

    def __call__(self, batch: float, tokens: float) -> float:
        return self.a + self.per_seq * batch + self.per_token * tokens

    def latency(self, tokens_per_seq: float = 1.0) -> LatencyModel:
        """L(b) when each sequence computes `tokens_per_seq` tokens a step on average."""
        if not (math.isfinite(tokens_per_seq) and tokens_per_seq >= 1.0):
            raise ValueError(f"tokens per sequence must be >= 1 (a step computes at least one), "
                             f"got {tokens_per_seq!r}")
        return LatencyModel(self.a, self.per_seq + self.per_token * tokens_per_seq)


def fit_step_cost(shapes: Sequence[tuple[float, float]], seconds: Sequence[float]) -> StepCost:
    """Non-negative least squares of step time on (1, batch, total tokens).

    `shapes`: (batch, new tokens per sequence) as profiled (`engines.profile.profile_step_latency`);
    needs shapes that separate the three terms (two batch sizes at one token each, and one
    extend at least)."""
    x = np.asarray(shapes, dtype=float).reshape(-1, 2)
    y = np.asarray(seconds, dtype=float).ravel()
    if x.shape[0] != y.size:
        raise ValueError(f"fit_step_cost: {x.shape[0]} shapes but {y.size} times")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))) or np.any(x < 1) or np.any(y < 0):
        raise ValueError("fit_step_cost: batch and tokens must be >= 1 and times finite and >= 0")
    X = np.column_stack([np.ones(x.shape[0]), x[:, 0], x[:, 0] * x[:, 1]])
    if np.linalg.matrix_rank(X) < 3:
        raise ValueError("fit_step_cost needs shapes that separate batch from tokens: at least two "
                         "batch sizes and one step of more than one token per sequence")
    coef, _ = nnls(X, y)
    return StepCost(*(float(c) for c in coef))


# -------------------- contention --------------------
# Models that share hardware slow each other: the chain's contention term (docs/throughput-model.md).
#
# kappa_ij(b_i, b_j) is the share of model i's progress lost while model j is inside a step (i at
# batch b_i, j at b_j): i's step runs at rate 1 - kappa_ij then. It is measured at start-up
# (`engines.profile.profile_contention`) at a few batch-size pairs and interpolated in between.
#
# The chain keeps residual times, not rates, so a rate is charged as time when an overlap starts
# (`overlap`): when model y launches while x runs (or both launch at once), the two overlap for
# o = min(R_x / (1 - kappa_x), R_y / (1 - kappa_y)), and each one's residual grows by kappa * o.
# For two models this is exact (whichever finishes first, the other's remaining work then runs
# alone); with three or more, pairs are charged one after another and triple overlaps are
# approximated. A residual can at most grow to d / (1 - max kappa): the bounded extra residual.

MAX_KAPPA = 0.95  # a model that loses more than this while another steps is measured wrong
Point = tuple[int, int, int, int, float]  # (i, b_i, j, b_j, kappa_ij)


@dataclass(frozen=True)
class Contention:
    """Measured kappa_ij(b_i, b_j) at some batch-size pairs; zero for pairs never measured."""

    M: int
    points: tuple[Point, ...] = ()

    @classmethod
    def build(cls, M: int, points: Iterable[Sequence[float]]) -> "Contention":
        """Validate (i, b_i, j, b_j, kappa) points into a contention model for M models.

        Each measured pair (i, j) must cover a full grid of its batch sizes (every b_i with every
        b_j), so that interpolation between them is well defined.
        """
        if isinstance(M, bool) or not isinstance(M, (int, np.integer)) or M < 1:
            raise ValueError(f"Contention needs the number of models M >= 1, got {M!r}")
        out: dict[tuple[int, int, int, int], float] = {}
        for p in points:
            try:
                i, bi, j, bj, k = (int(p[0]), int(p[1]), int(p[2]), int(p[3]), float(p[4]))
            except (TypeError, ValueError, IndexError):
                raise ValueError(f"contention point must be (i, b_i, j, b_j, kappa), got {p!r}") from None
            if not (0 <= i < M and 0 <= j < M) or i == j:
                raise ValueError(f"contention point {tuple(p)}: models must be two different indices of 0..{M - 1}")
            if bi < 1 or bj < 1:
                raise ValueError(f"contention point {tuple(p)}: batch sizes must be >= 1")
            if not (math.isfinite(k) and 0.0 <= k <= MAX_KAPPA):
                raise ValueError(f"contention point {tuple(p)}: kappa = {k!r} must be in [0, {MAX_KAPPA}]")
            if (i, bi, j, bj) in out:
                raise ValueError(f"contention point for model {i} at {bi} against {j} at {bj} given twice")
            out[(i, bi, j, bj)] = k
        for (i, j) in {(i, j) for (i, _, j, _) in out}:
            xs = sorted({bi for (a, bi, c, _) in out if (a, c) == (i, j)})
            ys = sorted({bj for (a, _, c, bj) in out if (a, c) == (i, j)})
            missing = [(x, y) for x in xs for y in ys if (i, x, j, y) not in out]
            if missing:
                raise ValueError(f"contention of model {i} by {j}: batch pair {missing[0]} is missing from "
                                 f"the grid {xs} x {ys}")
        pts = tuple(sorted((i, bi, j, bj, k) for (i, bi, j, bj), k in out.items()))
        return cls(M=int(M), points=pts)

    @classmethod
    def from_samples(cls, M: int, samples: Iterable[object]) -> "Contention":
        """From measured samples with fields model, batch, other, other_batch and kappa (as
        `engines.profile.profile_contention` returns; no samples: no contention)."""
        return cls.build(M, [(s.model, s.batch, s.other, s.other_batch, s.kappa)  # type: ignore[attr-defined]
                             for s in samples])

    @property
    def is_zero(self) -> bool:
        return all(p[4] == 0.0 for p in self.points)

    def rounded(self, decimals: int) -> "Contention":
        """The same grid with kappa rounded (cache keys and the solve use the same values)."""
        return Contention(self.M, tuple((i, bi, j, bj, round(k, decimals)) for i, bi, j, bj, k in self.points))

    def table(self, N: int) -> np.ndarray:
        """K[i, j, b_i, b_j] for batch sizes 0..N (0 where either batch is 0 or (i, j) was not
        measured): piecewise linear between measured batch sizes, constant beyond them."""
        K = np.zeros((self.M, self.M, N + 1, N + 1))
        b = np.arange(1, N + 1)
        for (i, j) in sorted({(p[0], p[2]) for p in self.points}):
            grid = {(bi, bj): k for (a, bi, c, bj, k) in self.points if (a, c) == (i, j)}
            xs = np.array(sorted({x for x, _ in grid}), dtype=float)
            ys = np.array(sorted({y for _, y in grid}), dtype=float)
            G = np.array([[grid[(int(x), int(y))] for y in ys] for x in xs])  # (len xs, len ys)
            along_y = np.stack([np.interp(b, ys, row) for row in G])  # (len xs, N): each b_j
            K[i, j, 1:, 1:] = np.stack([np.interp(b, xs, col) for col in along_y.T], axis=1)
        return K

    def worst_loss(self) -> np.ndarray:
        """Per model, the sum over the others of the largest share it loses to each (capped): while
        every other model steps it runs at no less than 1 - this."""
        out = np.zeros(self.M)
        for i in range(self.M):
            out[i] = sum(max([p[4] for p in self.points if p[0] == i and p[2] == j], default=0.0)
                         for j in range(self.M) if j != i)
        return np.minimum(out, MAX_KAPPA)


def residual_bound(d_max: np.ndarray, contention: Contention | None) -> np.ndarray:
    """Largest residual (time units) each model can reach: d / (1 - worst loss), plus one unit
    for rounding where it loses anything. With no contention, d itself."""
    if contention is None or contention.is_zero:
        return d_max.astype(np.int64)
    loss = contention.worst_loss()
    return (np.ceil(d_max / (1.0 - loss)) + (loss > 0)).astype(np.int64)


def overlap(R: list[np.ndarray], b: list[np.ndarray], launched: list[np.ndarray], running: list[np.ndarray],
            K: np.ndarray, order: Sequence[int]) -> list[np.ndarray]:
    """Residuals after this epoch's overlaps are charged (vectorised over transitions).

    R[i]: residual of model i after the epoch's launches (its full step when it launched now),
    b[i] its batch, launched[i] / running[i] masks. For every pair where at least one launched
    now and both run, each one's residual grows by kappa * o (module docstring). Pairs are taken
    in `order` (heaviest first). Returns float residuals (the chain rounds them).
    """
    R = [r.astype(float, copy=True) for r in R]
    for ix, x in enumerate(order):
        for y in order[ix + 1:]:
            active = (launched[x] | launched[y]) & running[x] & running[y]
            if not active.any():
                continue
            kx, ky = K[x, y][b[x], b[y]], K[y, x][b[y], b[x]]
            if not (kx.any() or ky.any()):
                continue
            o = np.minimum(R[x] / (1.0 - kx), R[y] / (1.0 - ky))
            R[x] = np.where(active, R[x] + kx * o, R[x])
            R[y] = np.where(active, R[y] + ky * o, R[y])
    return R


# -------------------- spec --------------------
# Validated inputs of the throughput model (docs/throughput-model.md).
#
# Everything that can be wrong with user input is checked here, once, with a
# ValueError that names the offending row / model / threshold, so the solver
# and simulator can assume clean inputs.

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
class SystemSpec:
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
    ) -> "SystemSpec":
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

    def kappa_table(self, N: int) -> np.ndarray | None:
        """K[i, j, b_i, b_j] (`Contention.table`), or None without contention."""
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
    charges arbitrary fractions of a step (`overlap`), so residuals
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
