"""Full search for the throughput-optimal thresholds B* (docs/throughput-model.md, "The optimum").

Every feasible B (sum_i (B_i - 1) < N, 1 <= B_i <= N) is solved exactly; no
heuristic can miss the optimum.  Work is shared three ways:

* chains of one N are enumerated and solved in batches (one BFS, one
  block-diagonal solve), grouped by size predicted from the previous N;
* results are memoised in an LRU keyed by the rounded inputs;
* batches can be spread over worker processes.
"""

from __future__ import annotations

import time
from typing import Sequence

from ._cache import DEFAULT_CACHE, P_DECIMALS, SolveCache
from ._results import SearchResult, ThresholdTable, feasible_thresholds
from ._searcher import BATCH_STATES, Searcher, default_workers, solve_batch
from .dtmc import DEFAULT_MAX_STATES, DTMCResult
from .spec import ModelSpec, check_concurrency


def best_thresholds(
    spec: ModelSpec,
    N: int,
    *,
    max_states: int = DEFAULT_MAX_STATES,
    cache: SolveCache | None = None,
    workers: int | None = 1,
    progress: bool = False,
) -> SearchResult:
    """B* = argmax_B T(B) over all feasible B for concurrency N (exhaustive)."""
    N = check_concurrency(N)
    return Searcher(spec, max_states, cache, workers, progress).run([N])[0]


def threshold_table(
    spec: ModelSpec,
    max_concurrency: int,
    *,
    min_concurrency: int = 1,
    max_states: int = DEFAULT_MAX_STATES,
    cache: SolveCache | None = None,
    workers: int | None = 1,
    progress: bool = False,
) -> ThresholdTable:
    """B* and every candidate's throughput for N = min..max concurrency."""
    hi = check_concurrency(max_concurrency)
    lo = check_concurrency(min_concurrency)
    if lo > hi:
        raise ValueError(f"min_concurrency {lo} > max_concurrency {hi}")
    t0 = time.perf_counter()
    # Ascending N: each N's chain sizes predict the next N's, for batching.
    rows = Searcher(spec, max_states, cache, workers, progress).run(list(range(lo, hi + 1)))
    return ThresholdTable(tuple(rows), time.perf_counter() - t0)


def solve_grid(
    spec: ModelSpec,
    N: int,
    Bs: Sequence[Sequence[int]],
    *,
    max_states: int = DEFAULT_MAX_STATES,
) -> list[DTMCResult]:
    """Solve an arbitrary list of B for one N (batched, memory-bounded), in order."""
    N = check_concurrency(N)
    grid = [tuple(int(x) for x in b) for b in Bs]
    out: dict[tuple[int, ...], DTMCResult] = {}
    unique = list(dict.fromkeys(grid))
    for i in range(0, len(unique), 16):
        chunk = unique[i:i + 16]
        for r in solve_batch((spec, N, chunk, max_states, BATCH_STATES, 1 << 12)):
            out[r.B] = r
    return [out[b] for b in grid]


__all__ = [
    "feasible_thresholds", "best_thresholds", "threshold_table", "SearchResult",
    "ThresholdTable", "SolveCache", "DEFAULT_CACHE", "P_DECIMALS", "default_workers",
    "solve_grid",
]
