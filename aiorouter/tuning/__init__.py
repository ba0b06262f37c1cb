"""DTMC throughput model and delayed-batching threshold tuning (docs/throughput-model.md).

Pure numpy/scipy: nothing here imports torch or `engines`.  One module per concern: `inputs`
(specs, latency fits, contention), `statespace` (the chain's states), `solve` (its stationary
distribution), `dtmc` (throughput from it), `search` (B* over every feasible B), `quantum` (the
time quantum), `schedules` (sync and eager against delayed), `learned` (what serving teaches),
`tuner` and `service` (the router's tuning, with its background re-solve), `cli`.
The package exports what callers outside it use; the rest is reached through its module.
"""

from .inputs import Contention, LatencyModel, StepCost, SystemSpec, fit_step_cost
from .dtmc import choose_delta
from .schedules import DELAYED_MARGIN, choose_schedule, sync_throughput
from .search import SolveCache, best_thresholds, solve_grid, threshold_table

__all__ = [
    "Contention", "DELAYED_MARGIN", "LatencyModel", "SolveCache", "StepCost", "SystemSpec",
    "best_thresholds", "choose_delta", "choose_schedule", "fit_step_cost", "solve_grid",
    "sync_throughput", "threshold_table",
]
