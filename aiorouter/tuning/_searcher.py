"""Batched, cached, optionally parallel solving of many (N, B) chains.

Chains of one N are enumerated and solved together in batches of similar
predicted size (predicted from the same B at N - 1), so the per-level numpy
overhead of small chains is shared; a batch that outgrows its state budget is
split in halves.  Solved results go to a SolveCache.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Iterable, Sequence

from ._cache import DEFAULT_CACHE, SolveCache, rounded_spec
from ._results import SearchResult, feasible_thresholds
from .dtmc import BudgetExceeded, DTMCResult, solve_many
from .spec import ModelSpec

BATCH_STATES = 300_000  # target total states per BFS batch
UNKNOWN_SIZE = 2_000  # size guess for a B never solved at a smaller N
PARALLEL_MIN_STATES = 1_000_000  # below this much work a process pool costs more than it saves


def solve_batch(args: tuple) -> list[DTMCResult]:
    """Solve one batch; split it in halves while it is over its state budget."""
    spec, N, Bs, max_states, budget, hint = args
    try:
        return solve_many(spec, N, Bs, max_states=max_states, budget=budget, size_hint=hint)
    except BudgetExceeded:
        h = len(Bs) // 2
        return solve_batch((spec, N, Bs[:h], max_states, budget, hint // 2)) + solve_batch(
            (spec, N, Bs[h:], max_states, budget, hint // 2)
        )


def _make_batches(
    Bs: list[tuple[int, ...]], guess: dict[tuple[int, ...], float], target: int
) -> list[tuple[list[tuple[int, ...]], int]]:
    """Greedy packing of similar-size chains into batches of ~target states."""
    order = sorted(Bs, key=lambda b: guess.get(b, UNKNOWN_SIZE))
    batches: list[tuple[list[tuple[int, ...]], int]] = []
    cur: list[tuple[int, ...]] = []
    tot = 0.0
    for b in order:
        g = guess.get(b, UNKNOWN_SIZE)
        if cur and tot + g > target:
            batches.append((cur, int(tot)))
            cur, tot = [], 0.0
        cur.append(b)
        tot += g
    if cur:
        batches.append((cur, int(tot)))
    return batches


def _pool(workers: int) -> ProcessPoolExecutor:
    # fork is cheapest (no re-import of numpy/scipy); with other threads alive
    # (say, inside a server) forkserver avoids inheriting a held lock.
    methods = mp.get_all_start_methods()
    method = "fork" if "fork" in methods and threading.active_count() == 1 else None
    if method is None:
        method = "forkserver" if "forkserver" in methods else "spawn"
    return ProcessPoolExecutor(workers, mp_context=mp.get_context(method))


class Searcher:
    """Solves many (N, B) with batching, caching and size prediction."""

    def __init__(self, spec: ModelSpec, max_states: int, cache: SolveCache | None,
                 workers: int | None, progress: bool) -> None:
        self.spec = spec
        self.solve_spec = rounded_spec(spec)
        self.max_states = max_states
        self.cache = DEFAULT_CACHE if cache is None else cache
        self.workers = default_workers() if workers is None else max(1, int(workers))
        self.progress = progress
        self.sizes: dict[int, dict[tuple[int, ...], int]] = {}

    def _guess(self, N: int, Bs: Iterable[tuple[int, ...]]) -> dict[tuple[int, ...], float]:
        """Predicted states of each B at N, from N - 1 (and N - 2 for the growth)."""
        prev, prev2 = self.sizes.get(N - 1, {}), self.sizes.get(N - 2, {})
        common = [b for b in prev if b in prev2]
        # The ratio of totals, not the largest ratio: one chain that grew from
        # 2 states to 300 would otherwise inflate every guess 150-fold and cut
        # the batches so small that per-level overhead dominated.
        growth = (sum(prev[b] for b in common) / max(1, sum(prev2[b] for b in common))
                  if common else 3.0)
        out = {}
        for b in Bs:
            # A B new at this N: its neighbour with one threshold lower.
            near = [prev[b]] if b in prev else [
                prev[c] for j in range(len(b)) if b[j] > 1
                for c in [b[:j] + (b[j] - 1,) + b[j + 1:]] if c in prev]
            if near:
                out[b] = max(near) * growth
        return out

    def run(self, Ns: Sequence[int]) -> list[SearchResult]:
        M = self.spec.M
        out: list[SearchResult] = []
        bar = None
        if self.progress:
            from tqdm import tqdm

            total = sum(len(feasible_thresholds(M, N)) for N in Ns)
            bar = tqdm(total=total, desc="DTMC threshold search", unit="B", leave=False)
        pool: ProcessPoolExecutor | None = None
        try:
            for N in Ns:
                t0 = time.perf_counter()
                cands = feasible_thresholds(M, N)
                mkey = SolveCache.model_key(self.spec, N)
                got: dict[tuple[int, ...], DTMCResult] = {}
                for b in cands:
                    r = self.cache.get(mkey + (b,))
                    if r is not None:
                        got[b] = r
                todo = [b for b in cands if b not in got]
                if bar is not None:
                    bar.update(len(cands) - len(todo))
                guess = self._guess(N, todo)
                work = sum(guess.get(b, UNKNOWN_SIZE) for b in todo)
                parallel = self.workers > 1 and work >= PARALLEL_MIN_STATES
                # Enough batches to keep every worker busy, none too large.
                target = BATCH_STATES if not parallel else int(
                    max(BATCH_STATES // 10, min(BATCH_STATES, work / (2 * self.workers))))
                batches = _make_batches(todo, guess, target)
                batches.sort(key=lambda bg: -bg[1])  # largest first (LPT scheduling)
                args = [
                    (self.solve_spec, N, bs, self.max_states, max(3 * g, target),
                     min(g, 4 * BATCH_STATES))
                    for bs, g in batches
                ]
                if parallel and pool is None:
                    pool = _pool(self.workers)
                if parallel and len(args) > 1:
                    futures = [pool.submit(solve_batch, a) for a in args]
                    results_iter = (f.result() for f in as_completed(futures))
                else:
                    results_iter = map(solve_batch, args)
                for res in results_iter:
                    for r in res:
                        got[r.B] = r
                        self.cache.put(mkey + (r.B,), r)
                    if bar is not None:
                        bar.update(len(res))
                self.sizes[N] = {b: r.num_states for b, r in got.items()}
                ordered = tuple(got[b] for b in cands)
                best = max(ordered, key=lambda r: r.throughput)
                out.append(SearchResult(N, best.B, best.throughput, ordered,
                                        time.perf_counter() - t0))
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
            if bar is not None:
                bar.close()
        return out


def default_workers() -> int:
    """Worker processes used for workers=None: the CPUs, at most 4."""
    return max(1, min(4, os.cpu_count() or 1))
