"""Result types of the threshold search, and the feasible set it covers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .dtmc import DTMCResult
from .spec import check_concurrency


def feasible_thresholds(M: int, N: int) -> list[tuple[int, ...]]:
    """All B in {1..N}^M with sum_i (B_i - 1) < N (no deadlock), lexicographic."""
    N = check_concurrency(N)
    out: list[tuple[int, ...]] = []

    def rec(prefix: tuple[int, ...], slack: int) -> None:
        if len(prefix) == M:
            out.append(prefix)
            return
        for extra in range(slack + 1):  # extra = B_i - 1
            rec(prefix + (extra + 1,), slack - extra)

    rec((), N - 1)
    return out


@dataclass(frozen=True)
class SearchResult:
    """B* for one N, with the predicted throughput of every feasible candidate."""

    N: int
    best: tuple[int, ...]
    best_throughput: float
    candidates: tuple[DTMCResult, ...]  # one per feasible B, in feasible_thresholds order
    seconds: float

    def throughput_of(self, B: Sequence[int]) -> float:
        key = tuple(B)
        for r in self.candidates:
            if r.B == key:
                return r.throughput
        raise KeyError(f"B = {key} is not a feasible candidate for N = {self.N}")

    @property
    def result(self) -> DTMCResult:
        return next(r for r in self.candidates if r.B == self.best)


@dataclass(frozen=True)
class ThresholdTable:
    """SearchResult for every N in a range (the router's start-up table)."""

    rows: tuple[SearchResult, ...]
    seconds: float

    def __getitem__(self, N: int) -> SearchResult:
        for r in self.rows:
            if r.N == N:
                return r
        raise KeyError(f"no row for N = {N}")

    def best(self, N: int) -> tuple[int, ...]:
        return self[N].best

    @property
    def concurrencies(self) -> tuple[int, ...]:
        return tuple(r.N for r in self.rows)
