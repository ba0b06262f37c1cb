"""Breadth-first enumeration of the DTMC's reachable states, vectorised.

A state is three small ints per model: k (queue), b (batch, 0 = idle) and r
(residual, in units of the gcd of all batch durations).  Each BFS level
expands the whole frontier at once:

1. tau = min residual of running models; the completing set A = argmin.
2. Completing models go idle and their requests are pooled in the queues, so
   only the SUM of their multinomials matters; that convolved distribution
   is tabulated once per "completion signature" (b_i for i in A, else 0).
3. Each state is repeated once per routing outcome and the targets' keys are
   summed from per-model lookup tables (`_packing`): the launch rule is in
   the tables, so no target's fields are built.  Keys are looked up / added
   in an open-addressing hash map and only new states are decoded.

Several threshold vectors B are enumerated in one BFS (the chain index is part
of the key): small chains are dominated by per-level numpy overhead, which a
batch shares.  The BFS stops as soon as a chain passes `max_states`, or the
batch passes its `budget` (the caller then splits the batch).  States keep
BFS order (the solver picks its own order); chain c's start state is id c.

With contention (models sharing hardware, `contention.overlap`), a launch that overlaps another
model's step lengthens both residuals: that part of a target's key depends on several models at
once, so it is added to the table-built key as a per-transition correction.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from ._hashtable import Int64Map
from ._outcomes import OutcomeTables
from ._packing import KEY_LIMIT, Encoder, KeySpaceError
from .contention import overlap


class StateLimitError(ValueError):
    """The reachable state space is larger than the configured limit."""


class BudgetExceeded(Exception):
    """A multi-chain batch grew past its budget; split it and retry."""


@dataclass
class ChainBatch:
    """Reachable states of several chains (BFS order) and their transitions."""

    Bs: list[tuple[int, ...]]
    cid: np.ndarray  # (n,) chain of each state
    K: np.ndarray  # (n, M) post-launch queue lengths
    Bt: np.ndarray  # (n, M) running batch sizes, 0 = idle
    R: np.ndarray  # (n, M) residuals in units, 0 = idle
    tau: np.ndarray  # (n,) holding time in units
    done: np.ndarray  # (n, M) batch completing at the end of the hold (0 = none)
    counts: np.ndarray  # (n,) transitions out of each state; they are stored source by source
    dst_ext: np.ndarray  # (T + n,) targets, then n self-ids (the solver's unit diagonal)
    prob_ext: np.ndarray  # (T + n,) probabilities, then n times -1
    unit: int  # quanta per time unit
    rmax: np.ndarray  # (M,) largest residual each model can have, in units
    contended: bool = False  # residuals can grow (contention): see _blocks.solver_order

    @property
    def n(self) -> int:
        return self.K.shape[0]

    @property
    def nB(self) -> int:
        return len(self.Bs)

    @property
    def dst(self) -> np.ndarray:
        return self.dst_ext[: self.dst_ext.size - self.n]

    @property
    def prob(self) -> np.ndarray:
        return self.prob_ext[: self.prob_ext.size - self.n]

    @cached_property
    def indptr(self) -> np.ndarray:  # state s's transitions: indptr[s]:indptr[s+1]
        return np.concatenate([[0], np.cumsum(self.counts)])

    @cached_property
    def src(self) -> np.ndarray:
        return np.repeat(np.arange(self.n, dtype=np.int32), self.counts)

    @property
    def start(self) -> np.ndarray:
        return np.arange(self.nB)

    def sizes(self) -> np.ndarray:
        return np.bincount(self.cid, minlength=self.nB)

    def transitions_per_chain(self) -> np.ndarray:
        return np.bincount(self.cid, weights=self.counts, minlength=self.nB).astype(np.int64)


def enumerate_chains(
    P: np.ndarray,
    d_units: np.ndarray,
    unit: int,
    N: int,
    Bs: Sequence[tuple[int, ...]],
    max_states: int,
    budget: int | None = None,
    size_hint: int = 1 << 12,
    kappa: np.ndarray | None = None,
    rmax: np.ndarray | None = None,
) -> ChainBatch:
    """BFS from the start state of every B in Bs at once.

    `kappa` (M, M, N+1, N+1): contention (`contention.Contention.table`), with `rmax` the
    residual bound per model in units (`contention.residual_bound`).
    """
    M, nB = P.shape[0], len(Bs)
    Barr = np.array(Bs, dtype=np.int64).reshape(nB, M)
    rmax = d_units.max(axis=1).astype(np.int64) if rmax is None else np.asarray(rmax, dtype=np.int64)
    try:
        enc = Encoder(M, N, rmax)
    except KeySpaceError as e:
        raise StateLimitError(str(e)) from None
    if nB * enc.space >= KEY_LIMIT:
        raise BudgetExceeded()
    steps = enc.step_tables(Barr, d_units)
    space = np.int64(enc.space)
    tables = OutcomeTables(P, N)
    big = np.int32(rmax.max() + 1)
    order = [int(i) for i in np.argsort(-d_units.max(axis=1), kind="stable")]  # heaviest first
    width = (N + 1) ** 2

    # Start: all N wait at model 0, everyone idle; the tables apply the launch rule.
    chains = np.arange(nB, dtype=np.int64)
    keys0 = chains * space + steps[0][chains * width + N]
    for j in range(1, M):
        keys0 += steps[j][chains * width]
    hmap = Int64Map(size_hint)
    hmap.insert_new(keys0)
    cid, K, Bt, R = enc.decode(keys0)
    per_chain = np.ones(nB, dtype=np.int64)

    names = ["cid", "tau", "counts"] + [f"{f}{i}" for f in ("K", "Bt", "R", "done") for i in range(M)]
    lv: dict[str, list[np.ndarray]] = {k: [] for k in names + ["dst", "prob"]}
    while cid.shape[0]:
        tau = np.full(cid.shape[0], big, dtype=np.int32)
        for i in range(M):
            np.minimum(tau, np.where(Bt[i] > 0, R[i], big), out=tau)
        comp = [(Bt[i] > 0) & (R[i] == tau) for i in range(M)]
        done = [np.where(comp[i], Bt[i], 0) for i in range(M)]
        sig = done[0].astype(np.int64)
        for i in range(1, M):
            sig += done[i].astype(np.int64) * (N + 1) ** i
        cnt, off = tables.lookup(sig)
        total = int(cnt.sum())
        # Outcome index of every transition: off[s], off[s] + 1, ... per source s.
        flat = np.repeat(off - (np.cumsum(cnt) - cnt), cnt) + np.arange(total)
        # Key = part fixed by the source (chain, residuals of models still
        # running) + per model a table entry picked by (source, outcome).
        fixed = cid.astype(np.int64) * space
        for i in range(M):
            keep = (Bt[i] > 0) & ~comp[i]
            fixed += np.where(keep, R[i] - tau, 0).astype(np.int64) * enc.stride[i]
        keys = np.repeat(fixed, cnt)
        row0 = cid.astype(np.int64) * width
        for i in range(M):
            row = row0 + np.where(comp[i], 0, Bt[i]) * (N + 1) + K[i]
            keys += steps[i][np.repeat(row, cnt) + tables.vecs[i][flat]]
        prob = tables.probs[flat]
        if kappa is not None:
            keys, prob, cnt = _charge_overlaps(keys, prob, cnt, cid, K, Bt, R, comp, tau, flat, tables,
                                               Barr, d_units, kappa, order, rmax, enc.stride)
        for name, arr in (("cid", cid), ("tau", tau), ("counts", cnt)):
            lv[name].append(arr)
        for i in range(M):
            for f, arr in (("K", K), ("Bt", Bt), ("R", R), ("done", done)):
                lv[f"{f}{i}"].append(arr[i])
        ids = hmap.lookup(keys)
        new = np.flatnonzero(ids < 0)
        if new.size:
            nk, inv_new = np.unique(keys[new], return_inverse=True)
            ncid, nK, nBt, nR = enc.decode(nk)  # the next frontier, once the limits pass
            per_chain += np.bincount(ncid, minlength=nB)
            worst = int(per_chain.argmax())
            if per_chain[worst] > max_states:
                raise StateLimitError(
                    f"state space exceeds max_states = {max_states:,} for N = {N}, "
                    f"B = {tuple(Bs[worst])}; use a coarser delta (fewer quanta per step) "
                    "or raise max_states"
                )
            if budget is not None and nB > 1 and hmap.size + nk.size > budget:
                raise BudgetExceeded()
            ids[new] = hmap.insert_new(nk)[inv_new]
            cid, K, Bt, R = ncid, nK, nBt, nR
        else:
            cid = cid[:0]
        lv["dst"].append(ids.astype(np.int32))
        lv["prob"].append(prob)

    n = hmap.size
    # Self-ids with probability -1 after the transitions: the solver builds
    # I - T with its unit diagonal from them without another copy.
    lv["dst"].append(np.arange(n, dtype=np.int32))
    lv["prob"].append(np.full(n, -1.0))
    cat = {k: (v[0] if len(v) == 1 else np.concatenate(v)) for k, v in lv.items()}
    for f in ("K", "Bt", "R", "done"):
        cat[f] = np.stack([cat.pop(f"{f}{i}") for i in range(M)], axis=1)
    return ChainBatch(Bs=[tuple(int(x) for x in b) for b in Bs], unit=unit, rmax=rmax,
                      contended=kappa is not None, dst_ext=cat.pop("dst"), prob_ext=cat.pop("prob"), **cat)


def _charge_overlaps(keys, prob, cnt, cid, K, Bt, R, comp, tau, flat, tables, Barr, d_units, kappa, order,
                     rmax, stride) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Charge this epoch's overlaps (contention.overlap) into the targets' keys.

    A charged residual is rarely a whole number of units.  A model that launches now gets its
    step rounded to the nearest unit, like its step latency.  A running model's charge recurs
    with every step the others launch during its own, so rounding it one way would add up
    (deterministic rounding was off by up to 8 % in throughput at 2 units per fast step): it is
    rounded up with probability equal to its fraction and down otherwise, exact in expectation.
    Such a transition splits into up to M + 1, stored next to each other so each source's
    transitions stay contiguous (splitting the launching model's too doubled the transitions
    for < 1 % of accuracy).
    Returns (keys, probabilities, transitions per source).
    """
    M, rep = len(K), np.repeat
    launched, running, R0, b = [], [], [], []
    never = np.int64(np.iinfo(np.int32).max)
    for i in range(M):
        cont = (Bt[i] > 0) & ~comp[i]  # still running after this epoch, without a launch
        thr = np.where(cont, never, Barr[cid, i])  # a running model cannot launch
        k_new = rep(K[i], cnt) + tables.vecs[i][flat]
        go = k_new >= rep(thr, cnt)
        launched.append(go)
        running.append(go | rep(cont, cnt))
        R0.append(np.where(go, d_units[i][k_new], rep(np.where(cont, R[i] - tau, 0), cnt)).astype(np.int64))
        b.append(np.where(go, k_new, rep(np.where(cont, Bt[i], 0), cnt)))
    R1 = overlap(R0, b, launched, running, kappa, order)
    frac = []
    for i in range(M):
        r = np.minimum(R1[i], rmax[i])
        lo = np.floor(r).astype(np.int64)
        f = r - lo
        f[f < 1e-9] = 0.0  # float noise on whole charges
        f[launched[i]] = np.where(f[launched[i]] >= 0.5, 1.0, 0.0)  # launching: to the nearest
        hi = f > 1 - 1e-9
        lo[hi] += 1
        f[hi] = 0.0
        keys = keys + (lo - R0[i]) * stride[i]
        frac.append(f)
    fr = np.stack(frac, axis=1)  # (T, M)
    if not fr.any():
        return keys, prob, cnt
    # One uniform draw rounds every model's charge (comonotone): variant v rounds up the v models
    # with the largest fractions, with probability f_(v) - f_(v+1) (f_(0) = 1, f_(M+1) = 0).
    # Each marginal is exact, and a transition splits into at most M + 1, not 2^M.
    # rank[:, i]: model i's place among the fractions, largest first (ties by index); M is
    # small, so pairwise comparisons beat a per-row argsort (which took 15 % of a solve).
    rank = np.zeros(fr.shape, dtype=np.int64)
    for i in range(M):
        for j in range(M):
            if j != i:
                rank[:, i] += (fr[:, j] > fr[:, i]) | ((fr[:, j] == fr[:, i]) & (j < i))
    fs = np.zeros(fr.shape)
    for i in range(M):
        np.put_along_axis(fs, rank[:, i:i + 1], fr[:, i:i + 1], axis=1)
    bounds = np.concatenate([np.ones((fr.shape[0], 1)), fs, np.zeros((fr.shape[0], 1))], axis=1)
    pv = bounds[:, :-1] - bounds[:, 1:]  # (T, M + 1)
    keep = pv > 1e-12
    at, v = np.nonzero(keep)  # row-major: each transition's variants stay together
    ways = keep.sum(axis=1)
    keys, prob = keys[at], prob[at] * pv[at, v]
    for i in range(M):
        keys += np.where(rank[at, i] < v, stride[i], 0)
    first = np.cumsum(cnt) - cnt  # each source's first transition
    return keys, prob, np.add.reduceat(ways, first)


