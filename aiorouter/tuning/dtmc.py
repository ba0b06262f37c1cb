"""Throughput of delayed batching under routing: the DTMC of docs/throughput-model.md.

`solve_dtmc(spec, N, B)` enumerates the reachable states (vectorised BFS in
`statespace`), solves the stationary distribution (`solve`) and reports
throughput plus by-products.  `throughput(P, C, latencies, N, B)` is the
one-call convenience wrapper that validates raw inputs first.
"""

from __future__ import annotations

from dataclasses import dataclass
import time
from typing import Sequence

import numpy as np

from .inputs import (
    DEFAULT_DELTA,
    LatencyLike,
    SystemSpec,
    check_concurrency,
    check_thresholds,
    quanta_unit,
    residual_bound,
)
from .solve import stationary_batch
from .statespace import ChainBatch, enumerate_chains

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
