"""Breadth-first enumeration of the DTMC's reachable states, vectorised.

A state is three small ints per model: k (queue), b (batch, 0 = idle) and r
(residual, in units of the gcd of all batch durations).  Each BFS level
expands the whole frontier at once:

1. tau = min residual of running models; the completing set A = argmin.
2. Completing models go idle and their requests are pooled in the queues, so
   only the SUM of their multinomials matters; that convolved distribution
   is tabulated once per "completion signature" (b_i for i in A, else 0).
3. np.repeat expands each state into its routing outcomes, the launch rule is
   applied column-wise, and targets are packed into int64 keys that are
   looked up / inserted in an open-addressing hash map.

Several threshold vectors B are enumerated in one BFS (the chain index is part
of the key): small chains are dominated by per-level numpy overhead, which a
batch shares.  The BFS stops as soon as a chain passes `max_states`, or the
batch passes its `budget` (the caller then splits the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ._hashtable import Int64Map
from ._outcomes import OutcomeTables
from ._packing import KeySpaceError, Packer


class StateLimitError(ValueError):
    """The reachable state space is larger than the configured limit."""


class BudgetExceeded(Exception):
    """A multi-chain batch grew past its budget; split it and retry."""


@dataclass
class ChainBatch:
    """Reachable states of several chains, numbered chain by chain."""

    Bs: list[tuple[int, ...]]
    offsets: np.ndarray  # (nB + 1,) chain c owns states offsets[c]:offsets[c+1]
    cid: np.ndarray  # (n,) chain of each state
    K: np.ndarray  # (n, M) post-launch queue lengths
    Bt: np.ndarray  # (n, M) running batch sizes, 0 = idle
    R: np.ndarray  # (n, M) residuals in units, 0 = idle
    tau: np.ndarray  # (n,) holding time in units
    done: np.ndarray  # (n, M) batch completing at the end of the hold (0 = none)
    src: np.ndarray  # transitions: source state, non-decreasing (grouped by source)
    dst: np.ndarray  # transitions: target state
    prob: np.ndarray  # transitions: probability
    start: np.ndarray  # (nB,) start state of each chain
    unit: int  # quanta per time unit

    @property
    def n(self) -> int:
        return self.K.shape[0]

    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def transitions_per_chain(self) -> np.ndarray:
        # src is grouped by source and chains own contiguous id ranges.
        return np.diff(np.searchsorted(self.src, self.offsets))


def _launch(K: list[np.ndarray], Bt: list[np.ndarray], R: list[np.ndarray],
            thr: list, d: np.ndarray) -> None:
    """Step 4 in place: idle models with k_i >= B_i take their whole queue."""
    for i in range(len(K)):
        go = (Bt[i] == 0) & (K[i] >= thr[i])
        if go.any():
            k = K[i][go]
            Bt[i][go] = k
            R[i][go] = d[i][k]
            K[i][go] = 0


def enumerate_chains(
    P: np.ndarray,
    d_units: np.ndarray,
    unit: int,
    N: int,
    Bs: Sequence[tuple[int, ...]],
    max_states: int,
    budget: int | None = None,
    size_hint: int = 1 << 12,
) -> ChainBatch:
    """BFS from the start state of every B in Bs at once."""
    M, nB = P.shape[0], len(Bs)
    Barr = np.array(Bs, dtype=np.int32).reshape(nB, M)
    d32 = d_units.astype(np.int32)
    try:
        packer = Packer(M, N, d_units.max(axis=1))
    except KeySpaceError as e:
        raise StateLimitError(str(e)) from None
    if nB * packer.space >= 2**62:
        raise BudgetExceeded()
    space = np.int64(packer.space)
    tables = OutcomeTables(P, N)
    big = np.int32(d_units.max() + 1)

    def thresholds(cid: np.ndarray) -> list:
        # One chain: scalars broadcast; several: gather each row's own B.
        return [int(Barr[0, i]) if nB == 1 else Barr[cid, i] for i in range(M)]

    cid = np.arange(nB, dtype=np.int32)
    K = [np.zeros(nB, dtype=np.int32) for _ in range(M)]
    K[0][:] = N
    Bt = [np.zeros(nB, dtype=np.int32) for _ in range(M)]
    R = [np.zeros(nB, dtype=np.int32) for _ in range(M)]
    _launch(K, Bt, R, thresholds(cid), d32)
    hmap = Int64Map(size_hint)
    hmap.insert_new(cid * space + packer.keys(K, Bt, R))
    per_chain = np.ones(nB, dtype=np.int64)

    names = ["cid", "tau"] + [f"{f}{i}" for f in ("K", "Bt", "R", "done") for i in range(M)]
    lv: dict[str, list[np.ndarray]] = {k: [] for k in names + ["src", "dst", "prob"]}
    base = 0
    while K[0].shape[0]:
        n = K[0].shape[0]
        tau = np.full(n, big, dtype=np.int32)
        for i in range(M):
            np.minimum(tau, np.where(Bt[i] > 0, R[i], big), out=tau)
        comp = [(Bt[i] > 0) & (R[i] == tau) for i in range(M)]
        done = [np.where(comp[i], Bt[i], 0) for i in range(M)]
        lv["cid"].append(cid)
        lv["tau"].append(tau)
        for i in range(M):
            lv[f"K{i}"].append(K[i])
            lv[f"Bt{i}"].append(Bt[i])
            lv[f"R{i}"].append(R[i])
            lv[f"done{i}"].append(done[i])

        code = done[0].astype(np.int64)
        for i in range(1, M):
            code += done[i].astype(np.int64) * (N + 1) ** i
        cnt_row, off_row = tables.lookup(code)
        rep = np.repeat(np.arange(n), cnt_row)
        starts = np.cumsum(cnt_row) - cnt_row
        flat = np.arange(rep.size) - np.repeat(starts - off_row, cnt_row)

        K2 = [K[i][rep] + tables.vecs[i][flat] for i in range(M)]
        Bt2 = [np.where(comp[i], 0, Bt[i])[rep] for i in range(M)]
        R2 = [np.where((Bt[i] > 0) & ~comp[i], R[i] - tau, 0)[rep] for i in range(M)]
        cid2 = cid[rep]
        _launch(K2, Bt2, R2, thresholds(cid2), d32)
        keys = packer.keys(K2, Bt2, R2)
        if nB > 1:
            keys += cid2.astype(np.int64) * space
        ids = hmap.lookup(keys)
        new = np.flatnonzero(ids < 0)
        if new.size:
            nk, first, inv_new = np.unique(keys[new], return_index=True, return_inverse=True)
            sel = new[first]
            per_chain += np.bincount(cid2[sel], minlength=nB)
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
            K, Bt, R = [x[sel] for x in K2], [x[sel] for x in Bt2], [x[sel] for x in R2]
            cid = cid2[sel]
        else:
            K = [x[:0] for x in K]
        lv["src"].append((base + rep).astype(np.int32))
        lv["dst"].append(ids.astype(np.int32))
        lv["prob"].append(tables.probs[flat])
        base += n

    cat = {k: (v[0] if len(v) == 1 else np.concatenate(v)) for k, v in lv.items()}
    for f in ("K", "Bt", "R", "done"):
        cat[f] = np.stack([cat.pop(f"{f}{i}") for i in range(M)], axis=1)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(cat["cid"], minlength=nB))])
    Bs_out = [tuple(int(x) for x in b) for b in Bs]
    if nB == 1:  # already numbered chain by chain
        return ChainBatch(Bs=Bs_out, offsets=offsets, start=np.zeros(1, dtype=np.int32),
                          unit=unit, **cat)
    # Renumber chain by chain (stable: BFS order inside a chain).
    order = np.argsort(cat["cid"], kind="stable")
    newid = np.empty(order.size, dtype=np.int32)
    newid[order] = np.arange(order.size, dtype=np.int32)
    for name in ("cid", "K", "Bt", "R", "tau", "done"):
        cat[name] = cat[name][order]
    # Keep transitions grouped by source in id order (the solver relies on
    # it): each source's run of transitions moves as one segment.
    counts = np.bincount(cat["src"], minlength=order.size)
    old_ptr = np.concatenate([[0], np.cumsum(counts)])
    c = counts[order]
    new_ptr = np.concatenate([[0], np.cumsum(c)])
    take = np.repeat(old_ptr[order] - new_ptr[:-1], c) + np.arange(new_ptr[-1])
    cat["src"] = np.repeat(np.arange(order.size, dtype=np.int32), c)
    cat["dst"] = newid[cat["dst"][take]]
    cat["prob"] = cat["prob"][take]
    return ChainBatch(Bs=Bs_out, offsets=offsets, start=newid[np.arange(nB)], unit=unit, **cat)
