"""Per-step latency of one model as a function of its batch size.

The paper's model uses a constant step latency L_i.  Real decoders get slower
as the batch grows, so we also accept L_i(b) = a + c * b (seconds), fitted
from a start-up profile with :func:`fit_latency`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np


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

    @property
    def is_constant(self) -> bool:
        return self.c == 0.0

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
    """Least-squares fit of L(b) = a + c*b to a profile, clamped to a, c >= 0.

    When the unconstrained fit has a negative coefficient, that coefficient is
    pinned at 0 and the other is refitted (the constrained least-squares
    optimum for two non-negative parameters).
    """
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
    X = np.column_stack([np.ones_like(b), b])
    (a, c), *_ = np.linalg.lstsq(X, y, rcond=None)
    if c < 0:  # no growth with batch size: best constant
        a, c = float(y.mean()), 0.0
    elif a < 0:  # line through the origin
        a, c = 0.0, float(b @ y / (b @ b))
    return LatencyModel(a=float(max(a, 0.0)), c=float(max(c, 0.0)))
