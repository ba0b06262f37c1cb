"""DTMC throughput model and delayed-batching threshold tuning (docs/throughput-model.md).

Pure numpy/scipy: nothing here imports torch or `engines`.
"""

from .compare import ComparisonTable, LatencyComparison, compare_latency_models
from .contention import Contention
from .drift import RoutingDrift, observed_routing, routing_drift
from .dtmc import DEFAULT_MAX_STATES, DTMCResult, solve_dtmc, solve_many, throughput
from .latency import LatencyModel, StepCost, fit_latency, fit_step_cost
from .online import RoutingEstimator, TuningCancelled
from .schedules import DELAYED_MARGIN, Schedule, SyncResult, choose_schedule, sync_throughput
from .tuner import Proposal, Solved, Tuner, TunerConfig
from .quantum import DEFAULT_TABLE_STATES, DeltaChoice, choose_delta
from .search import (
    SearchResult,
    SolveCache,
    ThresholdTable,
    best_thresholds,
    feasible_thresholds,
    solve_grid,
    threshold_table,
)
from .served import ServedFit, StepSpan, fit_served
from .simulate import SimulationResult, simulate
from .spec import DEFAULT_DELTA, ModelSpec, is_feasible

SystemSpec = ModelSpec  # the name to use beside aiorouter.ModelSpec (one cooperating model)
from ._blocks import SolverError
from ._statespace import StateLimitError

__all__ = [
    "ComparisonTable", "Contention", "DEFAULT_DELTA", "DEFAULT_MAX_STATES", "DEFAULT_TABLE_STATES", "DTMCResult",
    "DeltaChoice", "LatencyComparison", "LatencyModel", "ModelSpec", "SystemSpec", "RoutingEstimator",
    "SearchResult", "SimulationResult", "SolveCache", "SolverError", "StateLimitError",
    "ThresholdTable", "Tuner", "TunerConfig", "best_thresholds", "choose_delta",
    "compare_latency_models", "feasible_thresholds", "fit_latency", "is_feasible", "simulate",
    "solve_dtmc", "solve_grid", "solve_many", "threshold_table", "throughput",
    "Proposal", "RoutingDrift", "Schedule", "Solved", "SyncResult", "TuningCancelled",
    "StepCost", "fit_step_cost", "choose_schedule", "DELAYED_MARGIN", "observed_routing", "routing_drift", "sync_throughput",
    "ServedFit", "StepSpan", "fit_served",
]
