"""Throughput of delayed batching under routing: the DTMC of docs/throughput-model.md.

`solve_dtmc(spec, N, B)` enumerates the reachable states (vectorised BFS in
`statespace`), solves the stationary distribution (`solve`) and reports
throughput plus by-products.  `throughput(P, C, latencies, N, B)` is the
one-call convenience wrapper that validates raw inputs first.  Also here: the
thresholds the chain admits (`feasible_thresholds`) and the time quantum a
start-up solve uses (`choose_delta`, from a state budget).
"""

from __future__ import annotations

from dataclasses import dataclass
import math
import time
from typing import Sequence

import numpy as np

from .inputs import (
    DEFAULT_DELTA,
    Contention,
    LatencyLike,
    SystemSpec,
    as_latency_model,
    check_concurrency,
    check_routing_matrix,
    check_thresholds,
    quanta_unit,
    residual_bound,
)
from .solve import stationary_batch
from .statespace import BudgetExceeded, ChainBatch, StateLimitError, enumerate_chains

DEFAULT_MAX_STATES = 2_000_000
DEFAULT_TOL = 1e-8  # relative residual of the stationary solve (throughput error ~1e-9)



@dataclass(frozen=True)
class DTMCResult:
    """Steady state of the chain for one (N, B).

    Times are seconds.  Per-model tuples are indexed like P's rows.
    `admission_delay[i]` is the mean wait from joining model i's queue to
    being launched (Little's law: time-average queue / arrival rate); it is
    NaN for a model that never receives requests, as is `mean_batch_size`
    for a model that never launches.
    """

    N: int
    B: tuple[int, ...]
    throughput: float  # committed tokens per second
    num_states: int
    num_transitions: int
    mean_batch_size: tuple[float, ...]  # per launch
    utilisation: tuple[float, ...]  # fraction of time busy
    admission_delay: tuple[float, ...]
    mean_admission_delay: float  # over all queue arrivals
    expected_tau: float  # E[tau], seconds per transition
    expected_tau_quanta: float  # E[tau] in quanta of delta
    expected_tokens: float  # E[g], tokens per transition
    step_rate: tuple[float, ...]  # request-steps per second on each model
    solve_seconds: float  # wall time of the batch it was solved in, per chain
    # 1 normally.  More means routing can trap requests in several closed sets
    # (e.g. absorbing models); the figures are then the long-run average of
    # the mixture the start state leads to (per-transition expectations).
    closed_classes: int = 1


def solve_dtmc(
    spec: SystemSpec,
    N: int,
    B: Sequence[int],
    *,
    max_states: int = DEFAULT_MAX_STATES,
    tol: float = DEFAULT_TOL,
) -> DTMCResult:
    """Build and solve the chain for concurrency N and thresholds B."""
    return solve_many(spec, N, [B], max_states=max_states, tol=tol)[0]


def solve_many(
    spec: SystemSpec,
    N: int,
    Bs: Sequence[Sequence[int]],
    *,
    max_states: int = DEFAULT_MAX_STATES,
    tol: float = DEFAULT_TOL,
    budget: int | None = None,
) -> list[DTMCResult]:
    """Solve several threshold vectors for one N in a single batch.

    With `budget`, raises BudgetExceeded when the batch's BFS grows past that
    many states in total (the search then splits the batch).
    """
    t0 = time.perf_counter()
    N = check_concurrency(N)
    Bt = [check_thresholds(B, spec.M, N) for B in Bs]
    if isinstance(max_states, bool) or not isinstance(max_states, (int, np.integer)) or max_states < 1:
        raise ValueError(f"max_states must be a positive integer, got {max_states!r}")
    d_units, unit, kappa, rmax = chain_inputs(spec, N)
    cb = enumerate_chains(spec.p_array(), d_units, unit, N, Bt, int(max_states), budget,
                          kappa=kappa, rmax=rmax)
    pi, _, classes = stationary_batch(cb, d_units, tol=tol, P=spec.p_array())
    seconds = (time.perf_counter() - t0) / len(Bt)
    return _summarise(spec, N, cb, pi, seconds, classes)


def chain_inputs(spec: SystemSpec, N: int) -> tuple[np.ndarray, int, np.ndarray | None, np.ndarray]:
    """(step lengths d[i, b] in time units, quanta per unit, contention table, residual bound)."""
    d = spec.quanta_table(N)
    unit = quanta_unit(d, spec.contention is not None)
    d_units = d // unit
    return d_units, unit, spec.kappa_table(N), residual_bound(d_units.max(axis=1), spec.contention)


def _summarise(
    spec: SystemSpec, N: int, cb: ChainBatch, pi: np.ndarray, seconds: float,
    classes: np.ndarray,
) -> list[DTMCResult]:
    M, nB = spec.M, len(cb.Bs)
    quantum = spec.delta * cb.unit  # seconds per time unit of the chain
    done = cb.done
    running = cb.Bt > 0
    w = pi * cb.tau  # time weights: each state is held for tau units
    gamma, P = spec.tokens_per_step(), spec.p_array()

    def tot(weights: np.ndarray, feature: np.ndarray) -> np.ndarray:  # per chain
        if nB == 1:  # one pass, no temporary (bincount with weights is ~5x slower)
            return np.einsum("i,i->", weights, feature.astype(float, copy=False))[None]
        return np.bincount(cb.cid, weights=weights * feature, minlength=nB)

    def cols(weights: np.ndarray, X: np.ndarray) -> np.ndarray:  # (n, M) -> (nB, M)
        return np.stack([tot(weights, X[:, i]) for i in range(M)], axis=1)

    e_tau = np.array([w.sum()]) if nB == 1 else np.bincount(cb.cid, weights=w, minlength=nB)
    busy = cols(w, running) / e_tau[:, None]
    queue = cols(w, cb.K)  # time-integrated queue length
    # No `@` here: numpy hands float matmuls to a threaded BLAS, which on a
    # busy 2-core box spins for far longer than these M-term sums take.
    e_g = sum(gamma[i] * tot(pi, done[:, i]) for i in range(M))
    steps = cols(pi, done)  # request-steps completed on each model
    arrivals = np.stack([sum(P[i, j] * steps[:, i] for i in range(M)) for j in range(M)], axis=1)
    # Every batch launched completes once: batches per transition = completions per transition
    # (a launch cannot be told from a state's residual once contention lengthens it).
    n_launch = cols(pi, done > 0)
    sum_b = steps
    sizes, ntrans = cb.sizes(), cb.transitions_per_chain()
    nan = float("nan")
    out = []
    for c in range(nB):
        et = e_tau[c] * quantum
        arr, q = arrivals[c], queue[c]
        out.append(DTMCResult(
            N=N,
            B=cb.Bs[c],
            throughput=float(e_g[c] / et),
            num_states=int(sizes[c]),
            num_transitions=int(ntrans[c]),
            mean_batch_size=tuple(
                float(s / k) if k > 0 else nan for s, k in zip(sum_b[c], n_launch[c])
            ),
            utilisation=tuple(float(x) for x in busy[c]),
            admission_delay=tuple(
                float(qi / ai * quantum) if ai > 0 else nan for qi, ai in zip(q, arr)
            ),
            mean_admission_delay=float(q.sum() / arr.sum() * quantum) if arr.sum() > 0 else nan,
            expected_tau=float(et),
            expected_tau_quanta=float(e_tau[c] * cb.unit),
            expected_tokens=float(e_g[c]),
            step_rate=tuple(float(s / et) for s in steps[c]),
            solve_seconds=seconds,
            closed_classes=int(classes[c]),
        ))
    return out


def throughput(
    P: object,
    C: object,
    latencies: Sequence[LatencyLike],
    N: int,
    B: Sequence[int],
    *,
    delta: float = DEFAULT_DELTA,
    max_states: int = DEFAULT_MAX_STATES,
) -> DTMCResult:
    """Validate raw inputs and solve one (N, B).  Latencies: seconds or LatencyModel."""
    spec = SystemSpec.build(P, C, latencies, delta)
    return solve_dtmc(spec, N, B, max_states=max_states)


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


# -------------------- the quantum --------------------
# The time quantum delta for a start-up solve, chosen from a state budget.
#
# Solve time grows with the number of states; "40 quanta for the fastest step"
# bounds nothing (a slow model at a large batch can be hundreds of quanta).
# The state count of a chain is very nearly kappa * e_{M-1}(D), where D_i is
# model i's longest step (at batch = cap) in time units (quanta / the gcd of
# all step lengths) and e_{M-1} the elementary symmetric polynomial of degree
# M - 1: at each epoch one model has just launched or is idle, the other
# residuals range freely.  kappa depends on P, N and the thresholds, not on
# delta (measured: within ~15 % from 4 to 1000 units).  So:
#
# 1. one BFS-only pass over the whole table (every N <= cap, every feasible B)
#    at a coarse delta gives kappa for the largest chain (N = cap, B = 1) and
#    the table/largest-chain ratio;
# 2. among candidate deltas (a fine geometric ladder plus exact divisors of
#    each model's step) whose predicted table fits the budget, take the one
#    with the smallest relative rounding error of the step latencies (ties:
#    the coarser, cheaper one);
# 3. count the largest chain at that delta exactly and shrink if it overshoots.
#
# With contention the unit is one quantum (`spec.quanta_unit`) and a model's longest residual is
# d / (1 - its worst loss).  Overlap charges are rounded at random to the quanta on either side
# (`statespace`, charging overlaps), exact in expectation, so they add no error term here.

DEFAULT_TABLE_STATES = 6_000_000  # all chains of the table: ~6 s of one core here
FINEST_QUANTA = 200  # never finer than 1/200 of the fastest step (rounding <= 0.25 %)
LADDER_STEP = 1.002  # candidate deltas 0.2 % apart


@dataclass(frozen=True)
class DeltaChoice:
    """The chosen quantum and what it costs and loses."""

    delta: float  # seconds
    table_states: int  # predicted states of all chains N = 1..cap, every feasible B
    largest_chain: int  # exact states of the chain N = cap, B = (1, ..., 1)
    max_error: float  # max over models and b = 1..cap of |rounded L_i(b) - L_i(b)| / L_i(b)
    mean_error: float
    budget: int

    def describe(self) -> str:
        return (f"delta = {self.delta * 1e3:.4g} ms: ~{self.table_states:,} states in the table "
                f"(budget {self.budget:,}; largest chain {self.largest_chain:,}), step latencies "
                f"rounded by at most {100 * self.max_error:.2f} % (mean {100 * self.mean_error:.2f} %)")


def _latency_grid(latencies: Sequence[LatencyLike], cap: int) -> np.ndarray:
    models = [as_latency_model(x, i) for i, x in enumerate(latencies)]
    b = np.arange(1, cap + 1)
    return np.array([m.a + m.c * b for m in models])  # (M, cap), seconds, as LatencyModel computes


def _candidates(L: np.ndarray) -> np.ndarray:
    lo, hi = L.min() / FINEST_QUANTA, L.max()
    ladder = lo * LADDER_STEP ** np.arange(int(math.log(hi / lo) / math.log(LADDER_STEP)) + 1)
    exact = [v / np.arange(1, int(v / lo) + 1) for v in L[:, 0]]  # zero error at batch 1
    return np.unique(np.concatenate([ladder, *exact, [hi]]))


def _evaluate(L: np.ndarray, deltas: np.ndarray, contention: Contention | None = None
              ) -> tuple[np.ndarray, ...]:
    """Per candidate: e_{M-1}(D) in units, max and mean relative rounding error."""
    d = np.maximum(1, np.rint(L[None] / deltas[:, None, None])).astype(np.int64)
    err = np.abs(d * deltas[:, None, None] - L[None]) / L[None]
    err_max, err_mean = err.max(axis=(1, 2)), err.mean(axis=(1, 2))
    if contention is None:
        unit = np.gcd.reduce(d.reshape(d.shape[0], -1), axis=1)
        D = (d[:, :, -1] // unit[:, None]).astype(float)  # longest step (b = cap) per model
    else:
        D = d[:, :, -1] / (1.0 - contention.worst_loss())[None, :]
    proxy = D.prod(axis=1) * (1.0 / D).sum(axis=1) if L.shape[0] > 1 else np.ones(len(deltas))
    return proxy, err_max, err_mean


def _count(spec: SystemSpec, N: int, Bs: list[tuple[int, ...]], limit: int) -> np.ndarray | None:
    """States of each chain (BFS only), or None past `limit` states in all."""
    d_units, unit, kappa, rmax = chain_inputs(spec, N)
    try:
        cb = enumerate_chains(spec.p_array(), d_units, unit, N, Bs, limit, budget=limit, kappa=kappa,
                              rmax=rmax)
        return cb.sizes()
    except BudgetExceeded:
        if len(Bs) == 1:
            return None
        h = len(Bs) // 2
        a, b = _count(spec, N, Bs[:h], limit), _count(spec, N, Bs[h:], limit)
        return None if a is None or b is None else np.concatenate([a, b])
    except StateLimitError:
        return None


def choose_delta(
    P: object,
    latencies: Sequence[LatencyLike],
    max_concurrency: int,
    *,
    table_states: int = DEFAULT_TABLE_STATES,
    max_states: int = DEFAULT_MAX_STATES,
    contention: Contention | None = None,
    min_concurrency: int = 1,
) -> DeltaChoice:
    """The most accurate delta whose threshold table (N = min_concurrency..cap) fits `table_states`.

    The largest chain also stays within `max_states` (the per-chain limit).  With `contention`
    the table is the contention chain's (see the module docstring).
    Raises ValueError on bad input or when no quantum fits (absurd budgets).
    """
    Pm = check_routing_matrix(P)
    cap = check_concurrency(max_concurrency)
    lo = check_concurrency(min_concurrency)
    if lo > cap:
        raise ValueError(f"min_concurrency {lo} > max_concurrency {cap}")
    if isinstance(table_states, bool) or not isinstance(table_states, (int, np.integer)) \
            or table_states < 1000:
        raise ValueError(f"table_states must be an integer >= 1000, got {table_states!r}")
    M = Pm.shape[0]
    if len(latencies) != M:
        raise ValueError(f"got {len(latencies)} latencies for M = {M} models; shapes must match")
    L = _latency_grid(latencies, cap)
    ones = (1,) * M
    if contention is not None and contention.M != M:
        raise ValueError(f"contention is for {contention.M} models but P has M = {M}")
    if contention is not None and contention.is_zero:
        contention = None

    def spec(delta: float) -> SystemSpec:
        return SystemSpec.build(Pm, np.ones((M, M)), list(latencies), float(delta), contention)

    deltas = _candidates(L)
    proxy, err_max, err_mean = _evaluate(L, deltas, contention)

    def at_most(x: float) -> int:  # the finest candidate whose e_{M-1}(D) is <= x
        fit = np.flatnonzero(proxy <= x)
        return int(fit[np.argmax(proxy[fit])]) if fit.size else int(np.argmin(proxy))

    def probe(i: int, limit: int) -> tuple[int, int] | None:  # (table, largest chain), BFS only
        sp, total, largest = spec(deltas[i]), 0, 0
        for N in range(lo, cap + 1):
            Bs = feasible_thresholds(M, N)
            sizes = _count(sp, N, Bs, limit - total)
            if sizes is None:
                return None
            total += int(sizes.sum())
            largest = int(sizes[Bs.index(ones)]) if N == cap else largest
        return total, largest

    # 1. Probes from the coarsest delta up, at most 16x more units per step
    # (the estimate is rough while the steps are a handful of units), until
    # a probe costs ~1/30 of the budget.
    limit = max(1000, table_states // 8)
    ip, lo_fail, got = int(np.argmin(proxy)), np.inf, None
    for _ in range(12):
        res = probe(ip, limit)
        if res is None:
            lo_fail = min(lo_fail, proxy[ip])
            if got is None:
                raise ValueError(f"even the coarsest quantum ({deltas[ip] * 1e3:.3g} ms) gives more "
                                 f"than {limit:,} states; lower the concurrency cap")
            nxt = at_most(math.sqrt(proxy[got[0]] * proxy[ip]))  # halfway (in log) back
        else:
            got = (ip, *res)
            if res[0] >= limit / 4:
                break
            nxt = at_most(min(proxy[ip] * min(16.0, 0.8 * limit / res[0]), lo_fail * 0.9))
        if nxt == ip or proxy[nxt] <= proxy[got[0]]:
            break
        ip = nxt
    ip, total, largest = got
    ratio, kappa = total / largest, largest / proxy[ip]
    # 2./3. Choose; count the largest chain exactly; rescale if it overshoots
    # (its size is proportional to e_{M-1}(D), so one correction is enough).
    allowed = table_states / (ratio * kappa)
    limit = min(int(table_states / ratio) + 1, int(max_states))
    for _ in range(8):
        ok = np.flatnonzero(proxy <= allowed)
        # Errors equal to 1e-6 (float noise on exact multiples) tie; then the coarser wins.
        best = (ok[np.lexsort((-deltas[ok], np.round(err_max[ok], 6)))[0]] if ok.size
                else int(np.argmin(proxy)))
        sizes = _count(spec(deltas[best]), cap, [ones], 4 * limit)
        big = None if sizes is None else int(sizes[0])
        if big is not None and big <= limit:
            return DeltaChoice(float(deltas[best]), int(big * ratio), big, float(err_max[best]),
                               float(err_mean[best]), int(table_states))
        if not ok.size:
            break
        allowed = proxy[best] * (0.9 * limit / big if big else 0.125)
    raise ValueError(f"no quantum keeps the table under {table_states:,} states")
