"""Models that share hardware slow each other: the chain's contention term (docs/throughput-model.md).

kappa_ij(b_i, b_j) is the share of model i's progress lost while model j is inside a step (i at
batch b_i, j at b_j): i's step runs at rate 1 - kappa_ij then. It is measured at start-up
(`engines.profile.profile_contention`) at a few batch-size pairs and interpolated in between.

The chain keeps residual times, not rates, so a rate is charged as time when an overlap starts
(`overlap`): when model y launches while x runs (or both launch at once), the two overlap for
o = min(R_x / (1 - kappa_x), R_y / (1 - kappa_y)), and each one's residual grows by kappa * o.
For two models this is exact (whichever finishes first, the other's remaining work then runs
alone); with three or more, pairs are charged one after another and triple overlaps are
approximated. A residual can at most grow to d / (1 - max kappa): the bounded extra residual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

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
