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

    def __add__(self, other: "LatencyModel") -> "LatencyModel":
        """Two costs paid one after the other in every step (a model's step and the loop's work around it)."""
        return LatencyModel(self.a + other.a, self.c + other.c)

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
    from scipy.optimize import nnls

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
