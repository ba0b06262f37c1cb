"""Constant vs batch-dependent latency: how much does the prediction move?

The paper's model uses one step latency per model.  With L_i(b) = a_i + c_i b
a big batch takes longer, which penalises large thresholds.  This module
solves both models on the same grid of B so a benchmark can compare the two
predictions (and the optimum each picks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .dtmc import DEFAULT_MAX_STATES
from .latency import LatencyLike, LatencyModel, as_latency_model
from .search import feasible_thresholds, solve_grid
from .spec import DEFAULT_DELTA, ModelSpec, check_concurrency


@dataclass(frozen=True)
class LatencyComparison:
    """Predicted tokens/s for one B under both latency models."""

    B: tuple[int, ...]
    constant: float  # L_i = L_i(reference_batch) for every batch size
    batch_dependent: float  # L_i(b) = a_i + c_i * b

    @property
    def ratio(self) -> float:
        return self.batch_dependent / self.constant


@dataclass(frozen=True)
class ComparisonTable:
    N: int
    rows: tuple[LatencyComparison, ...]

    @property
    def best_constant(self) -> tuple[int, ...]:
        return max(self.rows, key=lambda r: r.constant).B

    @property
    def best_batch_dependent(self) -> tuple[int, ...]:
        return max(self.rows, key=lambda r: r.batch_dependent).B


def compare_latency_models(
    P: object,
    C: object,
    latency: Sequence[LatencyLike],
    N: int,
    Bs: Sequence[Sequence[int]] | None = None,
    *,
    reference_batch: int = 1,
    delta: float = DEFAULT_DELTA,
    max_states: int = DEFAULT_MAX_STATES,
) -> ComparisonTable:
    """Solve every B in `Bs` (default: all feasible) under both latency models.

    The constant model freezes each model's latency at L_i(reference_batch),
    the per-step latency one would measure at that batch size.
    """
    N = check_concurrency(N)
    if not 1 <= reference_batch <= N:
        raise ValueError(f"reference_batch must be in 1..N, got {reference_batch}")
    models = [as_latency_model(x, i) for i, x in enumerate(latency)]
    varying = ModelSpec.build(P, C, models, delta)
    constant = ModelSpec.build(
        P, C, [LatencyModel(a=m(reference_batch), c=0.0) for m in models], delta
    )
    grid = [tuple(b) for b in (Bs if Bs is not None else feasible_thresholds(varying.M, N))]
    const_res = solve_grid(constant, N, grid, max_states=max_states)
    var_res = solve_grid(varying, N, grid, max_states=max_states)
    rows = tuple(
        LatencyComparison(B=b, constant=c.throughput, batch_dependent=v.throughput)
        for b, c, v in zip(grid, const_res, var_res)
    )
    return ComparisonTable(N=N, rows=rows)
