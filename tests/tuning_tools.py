"""Test tools for aiorouter.tuning: a Monte Carlo simulator of the same dynamics as the chain,
and a solve of constant against batch-dependent latency on one grid of thresholds.

Monte Carlo check of the DTMC: the same dynamics, simulated in continuous time.

Independent of the chain code: no quantum, no state enumeration.  Each model
has a queue k_i, a running batch b_i and a completion time; at every
completion epoch the completing batches (all models finishing at the same
instant) route each request independently with P, count the committed tokens
c_ij actually realised, and then idle models with k_i >= B_i launch their
whole queue for L_i(b) seconds.

With contention (`spec.contention`) the models share hardware the way the chain assumes, but
simulated as rates, not as the chain's charges: each running model progresses at
1 - sum_j kappa_ij(b_i, b_j) over the other running models j, re-evaluated at every event.  For
two models the chain's charges are exactly this (docs/throughput-model.md); for more they
approximate it, and this simulator measures how well.

`schedule="sync"` simulates step-sync instead: models launch only when all are idle, and then
every model with requests steps them all (the round waits for the slowest).

Many independent replications advance in lock-step as numpy arrays, one event
per replication per step, so a million events take about a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from aiorouter.tuning.dtmc import DEFAULT_MAX_STATES
from aiorouter.tuning.inputs import (
    DEFAULT_DELTA, MAX_KAPPA, LatencyLike, LatencyModel, SystemSpec, as_latency_model, check_concurrency,
    check_thresholds,
)
from aiorouter.tuning.search import feasible_thresholds, solve_grid

TIE_EPS = 1e-12  # seconds: completions closer than this are simultaneous
SCHEDULES = ("delayed", "sync")


@dataclass(frozen=True)
class SimulationResult:
    N: int
    B: tuple[int, ...]
    throughput: float  # committed tokens per second (ratio estimator)
    throughput_stderr: float  # across replications
    mean_batch_size: tuple[float, ...]
    utilisation: tuple[float, ...]
    admission_delay: tuple[float, ...]
    mean_admission_delay: float
    expected_tau: float  # mean seconds between completion epochs
    expected_tokens: float  # mean committed tokens per epoch
    simulated_seconds: float  # over all replications, after warm-up
    events: int  # completion epochs after warm-up, all replications


def simulate(
    spec: SystemSpec,
    N: int,
    B: Sequence[int],
    *,
    events: int = 2000,
    warmup: int = 200,
    replications: int = 256,
    seed: int | None = 0,
    schedule: str = "delayed",
) -> SimulationResult:
    """Simulate `replications` independent systems for `events` epochs each.

    `schedule`: "delayed" (thresholds B; all ones is eager) or "sync" (B is then ignored).
    """
    N = check_concurrency(N)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    Bv = np.array(check_thresholds((1,) * spec.M if schedule == "sync" else B, spec.M, N))
    if events < 1 or warmup < 0 or replications < 2:
        raise ValueError("need events >= 1, warmup >= 0 and replications >= 2")
    rng = np.random.default_rng(seed)
    M, R = spec.M, int(replications)
    P, C = spec.p_array(), spec.c_array()
    cumP = np.cumsum(P, axis=1)[:, :-1]  # thresholds for inverse-CDF sampling
    lat = np.array([[lm(b) if b else 0.0 for b in range(N + 1)] for lm in spec.latency])
    kappa = spec.kappa_table(N)
    slots = np.arange(N)

    k = np.zeros((R, M), dtype=np.int64)
    b = np.zeros((R, M), dtype=np.int64)
    work = np.full((R, M), np.inf)  # solo seconds of work left, inf when idle
    k[:, 0] = N
    stats = _Stats(R, M)

    def launch() -> None:
        allowed = (b == 0).all(axis=1) if schedule == "sync" else np.ones(R, dtype=bool)
        for i in range(M):
            go = allowed & (b[:, i] == 0) & (k[:, i] >= Bv[i])
            if go.any():
                b[go, i] = k[go, i]
                k[go, i] = 0
                work[go, i] = lat[i, b[go, i]]
                stats.launch(go, i, b[go, i])

    def rates() -> np.ndarray:
        """Progress per second of each model now (1 without contention)."""
        loss = np.zeros((R, M))
        for i in range(M):
            for j in range(M):
                if j != i:
                    loss[:, i] += kappa[i, j][b[:, i], b[:, j]]  # 0 when either is idle
        return 1.0 - np.minimum(loss, MAX_KAPPA)

    launch()
    for step in range(warmup + events):
        if step == warmup:
            stats.reset()
        if kappa is None:
            dt = work.min(axis=1)
            # Re-base every clock on the new "now" so times stay small and float
            # error cannot grow with the simulated horizon (ties stay exact).
            work -= dt[:, None]
        else:
            rate = rates()
            left = work / rate  # inf when idle
            dt = left.min(axis=1)
            work = np.where(np.isinf(work), work, (left - dt[:, None]) * rate)
        stats.hold(dt, k, b)
        completing = work <= TIE_EPS
        arrivals = np.zeros((R, M), dtype=np.int64)
        for i in range(M):
            rows = np.flatnonzero(completing[:, i])
            if rows.size == 0:
                continue
            bi = b[rows, i]
            u = rng.random((rows.size, N))
            dest = (u[:, :, None] >= cumP[i][None, None, :]).sum(axis=2)
            live = slots[None, :] < bi[:, None]
            for j in range(M):
                m_j = ((dest == j) & live).sum(axis=1)
                arrivals[rows, j] += m_j
                stats.tokens[rows] += m_j * C[i, j]
            stats.steps[rows, i] += bi
            b[rows, i] = 0
            work[rows, i] = np.inf
        stats.arrived += arrivals
        stats.epochs += 1
        k += arrivals
        launch()
    return stats.result(N, tuple(int(x) for x in Bv))


class _Stats:
    """Accumulators per replication (so that a standard error is available)."""

    def __init__(self, R: int, M: int) -> None:
        self.R, self.M = R, M
        self.reset()

    def reset(self) -> None:
        R, M = self.R, self.M
        self.time = np.zeros(R)
        self.tokens = np.zeros(R)
        self.busy = np.zeros((R, M))
        self.queue = np.zeros((R, M))
        self.arrived = np.zeros((R, M))
        self.steps = np.zeros((R, M))
        self.launches = np.zeros(M)
        self.launched = np.zeros(M)
        self.epochs = 0

    def hold(self, dt: np.ndarray, k: np.ndarray, b: np.ndarray) -> None:
        self.time += dt
        self.busy += (b > 0) * dt[:, None]
        self.queue += k * dt[:, None]

    def launch(self, rows: np.ndarray, i: int, sizes: np.ndarray) -> None:
        self.launches[i] += sizes.size
        self.launched[i] += sizes.sum()

    def result(self, N: int, B: tuple[int, ...]) -> SimulationResult:
        T = self.time.sum()
        per_rep = self.tokens / self.time
        # Ratio estimator's standard error via the replications' spread.
        w = self.time / self.time.mean()
        se = float(np.std(per_rep * w, ddof=1) / math.sqrt(self.R))
        arr = self.arrived.sum(axis=0)
        q = self.queue.sum(axis=0)
        nan = float("nan")
        return SimulationResult(
            N=N,
            B=B,
            throughput=float(self.tokens.sum() / T),
            throughput_stderr=se,
            mean_batch_size=tuple(
                float(s / n) if n else nan for s, n in zip(self.launched, self.launches)
            ),
            utilisation=tuple(float(x) for x in self.busy.sum(axis=0) / T),
            admission_delay=tuple(float(qi / ai) if ai else nan for qi, ai in zip(q, arr)),
            mean_admission_delay=float(q.sum() / arr.sum()) if arr.sum() else nan,
            expected_tau=float(T / (self.epochs * self.R)),
            expected_tokens=float(self.tokens.sum() / (self.epochs * self.R)),
            simulated_seconds=float(T),
            events=int(self.epochs * self.R),
        )


# -------------------- constant vs batch-dependent latency --------------------
# Constant vs batch-dependent latency: how much does the prediction move?
#
# The paper's model uses one step latency per model.  With L_i(b) = a_i + c_i b
# a big batch takes longer, which penalises large thresholds.  This module
# solves both models on the same grid of B so a benchmark can compare the two
# predictions (and the optimum each picks).



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
    varying = SystemSpec.build(P, C, models, delta)
    constant = SystemSpec.build(
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
