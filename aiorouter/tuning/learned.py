"""What is learned while serving: the routing estimate, its drift from the matrix the thresholds
were solved for, and the refit of step costs and contention from served forwards.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
import threading
from typing import NamedTuple, Sequence

import numpy as np
from scipy.optimize import nnls

from .inputs import Contention, LatencyModel, MAX_KAPPA, StepCost, check_routing_matrix

# -------------------- online --------------------
# Online re-estimation of P (and C), and the Tuner: per concurrency, the schedule to run.
#
# The paper solves B once from an offline P.  Routing behaviour depends on the
# workload, so the router feeds every routing decision it takes into a
# RoutingEstimator; the Tuner (tuner.py) solves the threshold table and the
# per-N schedule, and re-solves when the routing drifts (`routing_drift`).


class TuningCancelled(Exception):
    """The Tuner's should_stop() said so mid-solve."""


class RoutingEstimator:
    """Counts routing decisions i -> j (and tokens committed by each move).

    The prior is `prior_strength` pseudo-decisions per row spread like the
    template P (each carrying the template's c_ij tokens), so the estimate
    starts at the template and moves towards the data as decisions arrive.
    """

    def __init__(self, template_P: object, template_C: object | None = None,
                 prior_strength: float = 100.0) -> None:
        P = check_routing_matrix(template_P)
        M = P.shape[0]
        C = np.ones((M, M)) if template_C is None else np.asarray(template_C, dtype=float)
        if C.shape != P.shape:
            raise ValueError(f"template C has shape {C.shape} but P has shape {P.shape}")
        if not prior_strength >= 0:
            raise ValueError(f"prior_strength must be >= 0, got {prior_strength!r}")
        self.M = M
        self._prior = prior_strength * P
        self._prior_tokens = self._prior * C
        self._template_C = C
        self._counts = np.zeros((M, M))
        self._tokens = np.zeros((M, M))
        self._lock = threading.Lock()

    def observe(self, src: int, dst: int, tokens: float | None = None, count: int = 1) -> None:
        """Record `count` decisions to move from model src to model dst."""
        if not (0 <= src < self.M and 0 <= dst < self.M):
            raise ValueError(f"routing decision {src} -> {dst} outside 0..{self.M - 1}")
        with self._lock:
            self._counts[src, dst] += count
            if tokens is not None:
                self._tokens[src, dst] += tokens
            else:
                self._tokens[src, dst] += count * self._template_C[src, dst]

    def observe_many(self, src: Sequence[int], dst: Sequence[int],
                     tokens: Sequence[float] | None = None) -> None:
        """Vectorised observe() for a whole batch of decisions."""
        s = np.asarray(src, dtype=np.int64)
        d = np.asarray(dst, dtype=np.int64)
        if s.shape != d.shape:
            raise ValueError("src and dst must have the same length")
        if s.size and (s.min() < 0 or d.min() < 0 or s.max() >= self.M or d.max() >= self.M):
            raise ValueError(f"routing decisions outside 0..{self.M - 1}")
        tk = self._template_C[s, d] if tokens is None else np.asarray(tokens, dtype=float)
        with self._lock:
            np.add.at(self._counts, (s, d), 1.0)
            np.add.at(self._tokens, (s, d), tk)

    @property
    def observations(self) -> int:
        return int(self._counts.sum())

    def counts(self) -> np.ndarray:
        with self._lock:
            return self._counts.copy()

    def totals(self) -> tuple[np.ndarray, np.ndarray]:
        """(decisions i -> j, tokens committed by them), copies taken together: a caller can
        difference two snapshots to test only recent decisions."""
        with self._lock:
            return self._counts.copy(), self._tokens.copy()

    def estimate(self) -> np.ndarray:
        """Posterior-mean P; a row with neither prior nor data stays 'stay put'."""
        with self._lock:
            tot = self._prior + self._counts
        rows = tot.sum(axis=1, keepdims=True)
        P = np.divide(tot, rows, out=np.zeros_like(tot), where=rows > 0)
        empty = rows[:, 0] == 0
        P[empty, :] = 0.0
        P[empty, np.flatnonzero(empty)] = 1.0
        return P

    def estimate_C(self) -> np.ndarray:
        """Mean committed tokens per move i -> j (the template where unseen)."""
        with self._lock:
            n = self._prior + self._counts
            t = self._prior_tokens + self._tokens
        return np.where(n > 0, t / np.where(n > 0, n, 1.0), self._template_C)

    def max_drift(self, reference_P: object) -> float:
        ref = np.asarray(reference_P, dtype=float)
        if ref.shape != (self.M, self.M):
            raise ValueError(f"reference P has shape {ref.shape}, expected {(self.M, self.M)}")
        return float(np.abs(self.estimate() - ref).max())

    def drifted(self, reference_P: object, margin: float) -> bool:
        """True when some entry of the estimate differs from reference_P by > margin."""
        if not margin >= 0:
            raise ValueError(f"margin must be >= 0, got {margin!r}")
        return self.max_drift(reference_P) > margin


# -------------------- drift --------------------
# Has the routing drifted from the P the thresholds were solved for?  (docs/throughput-model.md)
#
# Pure functions on counts of routing decisions (i -> j), so the caller decides what window of
# decisions to test (the Tuner uses those since its last solve).  An entry has drifted when it
# moved by more than `margin` AND by more than `z` standard errors of a row with that many
# decisions: a few hundred decisions cannot tell 0.35 from 0.40, and a margin alone would re-solve
# on noise.


@dataclass(frozen=True)
class RoutingDrift:
    """The outcome of one drift test."""

    drifted: bool
    observed_P: np.ndarray  # rows with enough decisions from the counts, the others from the reference
    entry: tuple[int, int] | None  # the entry that moved most (in standard errors), if any row was tested
    moved: float  # |observed - reference| at that entry
    z_score: float  # moved / its standard error
    decisions: int  # decisions in the tested rows
    row_decisions: tuple[int, ...]  # decisions per row (the sample size behind each observed row)


def observed_routing(counts: object, reference_P: object, min_row: int = 50) -> np.ndarray:
    """Row-normalised counts where a row has >= min_row decisions, else the reference row."""
    ref = check_routing_matrix(reference_P)
    c = np.asarray(counts, dtype=float)
    if c.shape != ref.shape:
        raise ValueError(f"routing counts have shape {c.shape}, expected {ref.shape}")
    if np.any(c < 0) or not np.all(np.isfinite(c)):
        raise ValueError("routing counts must be finite and non-negative")
    n = c.sum(axis=1)
    out = ref.copy()
    ok = n >= max(1, min_row)
    out[ok] = c[ok] / n[ok, None]
    return out


def routing_drift(reference_P: object, counts: object, *, margin: float = 0.05, z: float = 3.0,
                  min_row: int = 50) -> RoutingDrift:
    """Test the decision counts (M x M, i -> j) against the reference routing matrix."""
    if not margin >= 0 or not z >= 0:
        raise ValueError(f"margin and z must be >= 0, got {margin!r}, {z!r}")
    ref = check_routing_matrix(reference_P)
    obs = observed_routing(counts, ref, min_row)
    n = np.asarray(counts, dtype=float).sum(axis=1)
    tested = n >= max(1, min_row)
    best: tuple[float, tuple[int, int] | None, float] = (0.0, None, 0.0)
    drifted = False
    for i in np.flatnonzero(tested):
        for j in range(ref.shape[1]):
            moved = abs(obs[i, j] - ref[i, j])
            # Standard error under the reference (the null hypothesis); a reference of exactly
            # 0 or 1 gets the error of one decision in the row, so a single stray one is noise.
            se = max(math.sqrt(ref[i, j] * (1 - ref[i, j]) / n[i]), 1.0 / n[i])
            zs = moved / se
            if zs > best[0] or best[1] is None:
                best = (zs, (int(i), int(j)), moved)
            drifted |= moved > margin and zs > z
    return RoutingDrift(bool(drifted), obs, best[1], float(best[2]), float(best[0]), int(n[tested].sum()),
                        tuple(int(x) for x in n))


# -------------------- served --------------------
# What the models' steps cost while serving, and how much they slowed each other, from the spans
# of the forwards the runtime actually ran (docs/throughput-model.md, "Learning from served steps").
#
# Why: the start-up contention profile steps both models back to back, and there the light model
# barely notices the heavy one (cpu-tiny: kappa 0.00-0.05 for the small model). Served, the light
# model steps in short bursts between handoffs, each burst starting after (or while) the heavy
# model streams its weights through the caches: the small model's steps took 1.6x their profiled
# time (cpu-tiny, eager, N = 8), and the chain solved on the profile predicted 8-24 % more
# tokens/s than the sync and eager runs served (bench/RESULTS.md, "Runtime modes").
#
# The fit, per model i with the start-up step cost c_i(b, T) and the share o_ij of a step's time
# during which model j was inside a step of its own. The chain's rate rule (`contention`): a step
# that overlaps j for o * t of its t seconds at rate 1 - kappa does the work of t - kappa o t
# seconds alone, and that work is s_i * c_i(b, T). Two steps:
#
# 1. kappa from each step's speed against the profile, y = c_i(b, T) / t = 1 / s_i -
#    sum_j (kappa_ij / s_i) o_ij: least squares, non-negative. y is bounded, so a step stalled for
#    unrelated reasons (a GIL wait, a page fault) moves it little; regressing t itself on o t (t on
#    both sides) read such stalls as contention, and found kappa 0.35 between two sim engines
#    that sleep through their steps.
# 2. s_i from the total: sum of s_i c_i = sum of t (1 - sum_j kappa_ij o_ij), so the chain charges
#    exactly the time the model's steps took.
# 3. The shape: where the model served steps of varied batches, the work of a step is fitted as
#    s_a a_i + s_v (c_i(b, T) - a_i) (non-negative least squares), the fixed part and the part
#    that grows with the batch each on its own scale, and both are then scaled so that the totals
#    agree as in 2. One scale cannot bend the profile's line, and served batches can cost more or
#    less per sequence than the start-up profile's fit says. On cpu-tiny (bench.modes, fit on the
#    sync and eager runs) it found the small model's fixed part at 1.8x and its batch part at
#    1.2x, and the large model's at 1.02x and 1.12x; the chain's error over the N = 8 sweep went
#    from +0.5..+12.0 % to +0.9..+7.6 %. At N = 16 it stayed high (+8..+17 %, was +2..+14 %): the
#    fit sees the batches sync and eager served (mean 3.6-7 for the large model), and delayed runs
#    it at 12.7. The runtime's own re-solves fit the spans of the schedule it runs.
#    Where the batch part varies too little between steps (10th to 90th percentile under
#    MIN_SHAPE_SPREAD of the mean step), the shape is not identified and both scales are s_i.
#
# Where the overlap share barely varies (a light model that overlaps in every step) the slope is
# not identified (its standard error above 0.25, or the shares' 10th to 90th percentile under
# 0.2): kappa is then the start-up profile's (its mean over the profiled batch pairs), which
# measured that overlap directly, and the scale takes the rest. Identified, the light model's
# excess went to the scale, not to kappa (cpu-tiny, N = 4, sync and eager pooled: scale 1.72,
# kappa 0.01): it is slow after the heavy model's step, overlapping or not. Put on kappa instead,
# the chain over-predicted delayed B = (2, 7), where the light model overlaps less, by 13 %.

MIN_SPANS = 50  # steps a model needs before its fit replaces the profile
MAX_KAPPA_SE = 0.25  # a kappa less certain than this is not identified by the overlaps seen ...
# ... nor one whose overlap shares span less than this between their 10th and 90th percentiles:
# a few odd steps (a first prefill that ran alone) would otherwise set the intercept
MIN_OVERLAP_SPREAD = 0.2
MIN_SHAPE_SPREAD = 0.2  # the batch part's spread, as a share of the mean step, that identifies the shape


class StepSpan(NamedTuple):
    """One forward as the model's worker ran it (perf_counter seconds) and what it computed. The
    fields of `engines.engine.RunSpan`, in a type of the tuner's own: the background re-solve
    sends spans to a child process that imports only `aiorouter.tuning`, and a RunSpan would make
    it import the engines (and torch) to unpickle them."""

    start: float
    end: float
    batch: int  # sequences in the step
    tokens: int  # tokens computed, all sequences together

    @property
    def seconds(self) -> float:
        return self.end - self.start


def overlap_shares(mine: Sequence[StepSpan], other: Sequence[StepSpan]) -> np.ndarray:
    """[len(mine)] share of each of `mine`'s steps during which some step of `other` ran."""
    if not mine:
        return np.zeros(0)
    s = np.array([(x.start, x.end) for x in mine], dtype=float)  # (n, 2)
    if not other:
        return np.zeros(len(mine))
    o = np.array(sorted((x.start, x.end) for x in other), dtype=float)  # (m, 2), by start
    # Steps of one model never overlap each other, so the other's spans are disjoint and sorted:
    # for each of mine, only those starting before its end and ending after its start count.
    lo = np.searchsorted(o[:, 1], s[:, 0], side="right")  # first other span ending after my start
    hi = np.searchsorted(o[:, 0], s[:, 1], side="left")  # first other span starting after my end
    out = np.zeros(len(mine))
    for k in range(len(mine)):
        if hi[k] > lo[k]:
            seg = o[lo[k]:hi[k]]
            out[k] = np.clip(np.minimum(seg[:, 1], s[k, 1]) - np.maximum(seg[:, 0], s[k, 0]), 0.0, None).sum()
    return out / np.maximum(s[:, 1] - s[:, 0], 1e-12)


@dataclass(frozen=True)
class ServedFit:
    """Per model: scale on the profiled step cost (1: as profiled) and, per other model, kappa."""

    scales: tuple[float, ...]  # on the fixed part of the step cost (on all of it where slopes is empty)
    kappa: tuple[tuple[float, ...], ...]  # kappa[i][j]: share of i's progress lost while j steps
    steps: tuple[int, ...]  # spans each model's fit used (0: too few; that model kept the profile)
    # per model, seconds of its profiled step that are not the forward and are not scaled (the
    # hop to the worker and back, where the profile timed the step from the event loop)
    fixed: tuple[float, ...] = ()
    # per model, the scale on the part of the step cost that grows with the batch (its shape;
    # equal to `scales` where the steps did not identify it); empty: `scales` throughout
    slopes: tuple[float, ...] = ()

    def contention(self) -> Contention:
        """As the chain takes it: one kappa per ordered pair, at every batch size."""
        M = len(self.scales)
        return Contention.build(M, [(i, 1, j, 1, self.kappa[i][j]) for i in range(M) for j in range(M) if i != j])

    def _fixed(self, i: int) -> float:
        return self.fixed[i] if self.fixed else 0.0

    def _slope(self, i: int) -> float:
        return self.slopes[i] if self.slopes else self.scales[i]

    def step_costs(self, costs: Sequence[StepCost]) -> list[StepCost]:
        return [StepCost(max(c.a - self._fixed(i), 0.0) * s + self._fixed(i), c.per_seq * self._slope(i),
                         c.per_token * self._slope(i))
                for i, (c, s) in enumerate(zip(costs, self.scales))]

    def latencies(self, lats: Sequence[LatencyModel]) -> list[LatencyModel]:
        return [LatencyModel(max(m.a - self._fixed(i), 0.0) * s + self._fixed(i), m.c * self._slope(i))
                for i, (m, s) in enumerate(zip(lats, self.scales))]


def fit_served(spans: Sequence[Sequence[StepSpan]], cost: Sequence[object], min_spans: int = MIN_SPANS,
               fixed: Sequence[float] | None = None, prior: Contention | None = None) -> ServedFit:
    """Fit scales and kappa from each model's served steps. `cost[i]`: model i's profiled step
    time, as `cost(batch, tokens)` (a `StepCost`) or `cost(batch)` (a `LatencyModel`, decode
    only: its scale then also absorbs the extends a served step computes). `fixed[i]`: seconds of
    that profiled time spent outside the forward (a profile timed from the event loop includes
    the hop to the worker and back; a span does not): compared without them, never scaled.
    `prior`: the start-up contention profile; where the overlaps do not identify kappa, kappa is
    its mean over the profiled batch pairs (none: 0) and the scale takes the rest."""
    M = len(spans)
    if len(cost) != M or (fixed is not None and len(fixed) != M):
        raise ValueError(f"fit_served: {M} models' spans but {len(cost)} step costs"
                         + ("" if fixed is None else f" and {len(fixed)} fixed times"))
    fixed_t = tuple(float(f) for f in fixed) if fixed is not None else (0.0,) * M
    scales, kappa, used = [1.0] * M, [[0.0] * M for _ in range(M)], [0] * M
    slopes = [1.0] * M
    for i in range(M):
        mine = [x for x in spans[i] if x.seconds > 0]
        if len(mine) < min_spans:
            continue
        t = np.array([x.seconds for x in mine])
        base = np.maximum(np.array([_cost(cost[i], x) for x in mine]) - fixed_t[i], 1e-9)
        others = [j for j in range(M) if j != i]
        o = np.stack([overlap_shares(mine, spans[j]) for j in others], axis=1) if others else np.zeros((len(t), 0))
        free = [k for k in range(o.shape[1]) if o[:, k].any()]
        ks = _kappa_from_speed(base / t, o[:, free]) if free else np.zeros(0)
        if ks is None:  # not identified: kappa as profiled
            ks = np.array([_mean_kappa(prior, i, others[col]) for col in free])
        work = t * (1.0 - o[:, free] @ np.minimum(ks, MAX_KAPPA)) if free else t  # [n] seconds alone
        scales[i] = slopes[i] = float(work.sum() / max(base.sum(), 1e-18))
        shape = _shape(work, base, min(max(_fixed_part(cost[i]) - fixed_t[i], 0.0), float(base.min())))
        if shape is not None:
            scales[i], slopes[i] = shape
        for k, col in zip(ks, free):
            kappa[i][others[col]] = float(min(MAX_KAPPA, max(0.0, k)))
        if not (math.isfinite(scales[i]) and scales[i] > 0 and math.isfinite(slopes[i]) and slopes[i] > 0):
            scales[i] = slopes[i] = 1.0
        used[i] = len(mine)
    return ServedFit(tuple(scales), tuple(tuple(r) for r in kappa), tuple(used), fixed_t, tuple(slopes))


def _fixed_part(c: object) -> float:
    """The profiled step cost's part that does not grow with the batch (a)."""
    return float(c.a) if isinstance(c, (StepCost, LatencyModel)) else 0.0


def _shape(work: np.ndarray, base: np.ndarray, a: float) -> tuple[float, float] | None:
    """work ~ s_a a + s_v (base - a), then both scaled so the totals agree -> (s_a, s_v); None
    where the batch part does not vary enough to tell them apart (MIN_SHAPE_SPREAD) or the fit
    leaves either at zero."""
    var = np.maximum(base - a, 0.0)
    if a <= 0 or np.percentile(var, 90) - np.percentile(var, 10) < MIN_SHAPE_SPREAD * base.mean():
        return None
    (s_a, s_v), _ = nnls(np.column_stack([np.full(len(var), a), var]), work)
    if s_a <= 0 or s_v <= 0:
        return None
    k = work.sum() / (s_a * a * len(var) + s_v * var.sum())
    return float(s_a * k), float(s_v * k)


def _mean_kappa(prior: Contention | None, i: int, j: int) -> float:
    ks = [p[4] for p in (prior.points if prior is not None else ()) if p[0] == i and p[2] == j]
    return float(np.mean(ks)) if ks else 0.0


def _kappa_from_speed(y: np.ndarray, o: np.ndarray) -> np.ndarray | None:
    """y = alpha - sum_j gamma_j o_j, alpha, gamma >= 0 -> kappa_j = gamma_j / alpha; None where
    the overlaps do not identify it (MAX_KAPPA_SE, MIN_OVERLAP_SPREAD)."""
    X = np.column_stack([np.ones(len(y)), -o])  # (n, 1 + others)
    coef, _ = nnls(X, y)
    alpha = coef[0]
    if alpha <= 0:
        return None
    dof = max(1, len(y) - X.shape[1])
    sigma2 = float(((X @ coef - y) ** 2).sum()) / dof
    try:
        cov = sigma2 * np.linalg.inv(X.T @ X)
    except np.linalg.LinAlgError:
        return None
    se = np.sqrt(np.maximum(np.diag(cov)[1:], 0.0)) / alpha  # of each kappa, to first order
    spread = np.percentile(o, 90, axis=0) - np.percentile(o, 10, axis=0)
    if (se > MAX_KAPPA_SE).any() or (spread < MIN_OVERLAP_SPREAD).any():
        return None
    return coef[1:] / alpha


def _cost(c: object, x: StepSpan) -> float:
    return c(x.batch, x.tokens) if isinstance(c, StepCost) else c(x.batch)  # type: ignore[operator]
