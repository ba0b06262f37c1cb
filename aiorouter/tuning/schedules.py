"""Step-sync and eager as candidates beside delayed batching (docs/throughput-model.md).

Eager is delayed batching with every B_i = 1, so the chain predicts it already.  Step-sync is
another process: every model with requests steps all of them at once, and the round ends when
the slowest finishes.  Its state is just how the N requests are spread over the models (the
compositions of N into M parts: 17 for M = 2, N = 16), so it is solved exactly and in
milliseconds: a round from spread n commits sum_i n_i gamma_i tokens, lasts the time the models
in it take together (contention included: each progresses at 1 - sum_j kappa_ij while j runs),
and moves to the spread sum_i multinomial(n_i, p_i.).

`choose_schedule` then names, per N, the schedule the model predicts best.
"""

from __future__ import annotations

from dataclasses import dataclass
import time

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spl

from .inputs import MAX_KAPPA, SystemSpec, check_concurrency
from .search import SearchResult
from .solve import Segments, power
from .statespace import OutcomeTables, compositions

MODES = ("delayed", "eager", "sync")
# relative: within this the model cannot tell two schedules apart. At N = 1 every schedule runs
# the same steps, yet step-sync's exact formula and the chain's iterative solve (tolerance 1e-8)
# differed by 1.3e-6 (cpu-tiny, bench.modes), which at 1e-6 picked sync on a tie.
SAME = 1e-5
# A B* other than all ones must beat the better of eager and sync by more than this (choose_schedule)
DELAYED_MARGIN = 0.03


@dataclass(frozen=True)
class SyncResult:
    N: int
    throughput: float  # committed tokens per second
    round_seconds: float  # mean round length
    utilisation: tuple[float, ...]  # share of the time each model is inside a step
    num_states: int
    seconds: float  # solve time


def round_time(work: np.ndarray, batch: np.ndarray, kappa: np.ndarray | None) -> tuple[float, np.ndarray]:
    """(round length, each model's busy time) when models with work[i] > 0 solo-seconds start
    together; with contention each runs at 1 - sum_j kappa[i, j, b_i, b_j] over those still
    running, re-evaluated as models finish."""
    w, busy, t = work.astype(float).copy(), np.zeros(work.size), 0.0
    live = w > 0
    while live.any():
        rate = np.ones(w.size)
        if kappa is not None:
            for i in np.flatnonzero(live):
                loss = sum(kappa[i, j, batch[i], batch[j]] for j in np.flatnonzero(live) if j != i)
                rate[i] = 1.0 - min(loss, MAX_KAPPA)
        dt = float(np.min(w[live] / rate[live]))
        t += dt
        busy[live] += dt
        w[live] -= rate[live] * dt
        live &= w > 1e-12 * max(1.0, t)
    return t, busy


def sync_throughput(spec: SystemSpec, N: int) -> SyncResult:
    """Exact steady-state throughput of step-sync at concurrency N (closed loop).

    Step lengths are the chain's (rounded to spec.delta) so that the schedules compare alike.
    """
    t0 = time.perf_counter()
    N = check_concurrency(N)
    M = spec.M
    states = compositions(N, M)
    index = {s: k for k, s in enumerate(states)}
    lat = spec.quanta_table(N) * spec.delta  # [i, b] seconds, 0 at b = 0
    kappa = spec.kappa_table(N)
    gamma = spec.tokens_per_step()
    tables = OutcomeTables(spec.p_array(), N)
    S = len(states)
    codes = np.array([sum(n * (N + 1) ** i for i, n in enumerate(s)) for s in states], dtype=np.int64)
    cnt, off = tables.lookup(codes)
    rows, cols, vals = [], [], []
    dur, tokens, busy = np.zeros(S), np.zeros(S), np.zeros((S, M))
    for k, s in enumerate(states):
        b = np.array(s)
        dur[k], busy[k] = round_time(lat[np.arange(M), b], b, kappa)
        tokens[k] = float(b @ gamma)
        for o in range(off[k], off[k] + cnt[k]):
            rows.append(index[tuple(int(tables.vecs[i][o]) for i in range(M))])
            cols.append(k)
            vals.append(tables.probs[o])
    pi = _stationary(sp.csc_matrix((vals, (rows, cols)), shape=(S, S)), index[(N,) + (0,) * (M - 1)])
    e_t = float(pi @ dur)
    return SyncResult(N, float(pi @ tokens) / e_t, e_t, tuple(float(x) for x in (pi @ busy) / e_t), S,
                      time.perf_counter() - t0)


def _stationary(T_t: sp.csc_matrix, start: int) -> np.ndarray:
    """pi = T^T pi, sum 1 (T_t is T^T).  One equation is replaced by the normalisation; if that
    system is singular (routing traps requests in several closed sets), the long-run average
    from the start state instead (Cesaro mean of the lazy chain)."""
    S = T_t.shape[0]
    A = (T_t - sp.identity(S, format="csc")).tolil()
    A[0, :] = 1.0
    rhs = np.zeros(S)
    rhs[0] = 1.0
    try:
        pi = spl.splu(A.tocsc()).solve(rhs)
        if np.all(np.isfinite(pi)) and pi.min() > -1e-9 and np.abs(T_t @ pi - pi).max() < 1e-9:
            return np.clip(pi, 0.0, None) / np.clip(pi, 0.0, None).sum()
    except RuntimeError:  # exactly singular
        pass
    x = np.zeros(S)
    x[start] = 1.0
    pi, _ = power(lambda v: T_t @ v, Segments(np.zeros(S, dtype=np.int64), 1), x, 1e-10, 20000)
    return pi


@dataclass(frozen=True)
class Schedule:
    """The schedule to run at concurrency N and what the model predicts for each candidate."""

    N: int
    mode: str  # "delayed", "eager" or "sync"
    thresholds: tuple[int, ...]  # B for delayed (all ones for eager); () for sync
    predicted: float  # tokens/s of the chosen schedule
    delayed: float  # tokens/s of the best delayed thresholds (B*)
    best_thresholds: tuple[int, ...]  # B*
    eager: float
    sync: float

    @property
    def choice(self) -> tuple:
        """("delayed", B) / ("eager",) / ("sync",): what the runtime is to honour."""
        return ("delayed", self.thresholds) if self.mode == "delayed" else (self.mode,)

    def predicted_for(self, mode: str, thresholds: tuple[int, ...] | None = None,
                      row: SearchResult | None = None) -> float:
        """Predicted tokens/s of another choice at this N (delayed needs `row` for any B)."""
        if mode == "sync":
            return self.sync
        if mode == "eager":
            return self.eager
        if thresholds is None or tuple(thresholds) == self.best_thresholds:
            return self.delayed
        if row is None:
            raise ValueError("the throughput of a delayed B other than B* needs its SearchResult row")
        return row.throughput_of(thresholds)


def choose_schedule(row: SearchResult, sync: SyncResult | float, sync_margin: float = 0.0,
                    delayed_margin: float = 0.0) -> Schedule:
    """The best of delayed (B*), eager (B = 1) and step-sync at N = row.N.

    Delayed with B* = all ones is eager.  Sync is taken only when it beats the best delayed by
    more than `sync_margin` (a fraction; at least SAME): it is a different runtime loop, so a
    tie stays with delayed batching (at N = 1 every schedule runs the same steps).
    A B* other than all ones is taken only when it beats the better of eager and sync by more
    than `delayed_margin`: within that, the chain cannot rank them. On the smollm2 pair every
    schedule was predicted within 2 % of the others at N = 4, 8 and 16; at N = 16 the chain's
    B* = (3, 5), predicted 0.8 % over eager, measured 6 % under it (bench.modes).
    """
    if not sync_margin >= 0 or not delayed_margin >= 0:
        raise ValueError(f"sync_margin and delayed_margin must be >= 0, got {sync_margin!r}, {delayed_margin!r}")
    M = len(row.best)
    ones = (1,) * M
    s = sync.throughput if isinstance(sync, SyncResult) else float(sync)
    eager = row.throughput_of(ones) if row.candidates else float("nan")
    delayed = row.best_throughput
    kw = dict(N=row.N, delayed=delayed, best_thresholds=row.best, eager=eager, sync=s)
    if s > delayed * (1.0 + max(sync_margin, SAME)) or (np.isnan(delayed) and np.isfinite(s)):
        return Schedule(mode="sync", thresholds=(), predicted=s, **kw)
    if delayed_margin > 0 and row.best != ones:
        sync_wins = s > eager * (1.0 + max(sync_margin, SAME))
        simple = s if sync_wins else eager
        if not delayed > simple * (1.0 + delayed_margin):
            return (Schedule(mode="sync", thresholds=(), predicted=s, **kw) if sync_wins else
                    Schedule(mode="eager", thresholds=ones, predicted=eager, **kw))
    mode = "eager" if row.best == ones else "delayed"
    return Schedule(mode=mode, thresholds=row.best, predicted=delayed, **kw)
