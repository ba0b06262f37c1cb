"""The chain's state space: packed state keys, routing outcomes of completing batches, and the
vectorised breadth-first enumeration of the reachable states of many chains at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
import itertools
import math
from typing import Sequence

import numpy as np

from .inputs import overlap

# -------------------- packed state keys --------------------
# Injective int64 keys for DTMC states, linear per model so the BFS can build them.
#
# A model's fields (k, b, r) get one code: the index of the pair (k, b) among
# the pairs with k + b <= N (about half of (N+1)^2), times (rmax + 1), plus r.
# A state's key is sum_j code_j * stride_j (mixed radix over models), plus
# chain * space when several chains share one BFS.  Because the key is a SUM of
# per-model terms, the BFS gets a target's key from small lookup tables
# (`step_tables`) without materialising the target's fields; only states seen
# for the first time are decoded.

KEY_LIMIT = 2**62  # keys (chain offset included) stay below this


class KeySpaceError(ValueError):
    """The packed state key would not fit in 62 bits."""


class Encoder:
    """Per-model codes (k, b, r) -> int and the keys built from them."""

    def __init__(self, M: int, N: int, rmax: np.ndarray) -> None:
        self.M, self.N = M, N
        k, b = np.meshgrid(np.arange(N + 1), np.arange(N + 1), indexing="ij")
        ok = (k + b) <= N
        self.pair = np.full((N + 1, N + 1), -1, dtype=np.int64)  # pair[k, b] -> index
        self.pair[ok] = np.arange(int(ok.sum()))
        self.pk, self.pb = k[ok].astype(np.int32), b[ok].astype(np.int32)  # index -> k, b
        self.rrad = [int(v) + 1 for v in rmax]
        self.radix = [int(ok.sum()) * r for r in self.rrad]
        self.stride = [math.prod(self.radix[:j]) for j in range(M)]
        self.space = math.prod(self.radix)
        if self.space >= KEY_LIMIT:
            raise KeySpaceError(
                f"state encoding needs more than 62 bits (M = {M}, N = {N}, up to "
                f"{max(rmax)} time units per step); use a coarser delta or fewer models"
            )

    def code(self, j: int, k: np.ndarray, b: np.ndarray, r: np.ndarray) -> np.ndarray:
        """Model j's term of the key (already times its stride)."""
        return (self.pair[k, b] * self.rrad[j] + r) * self.stride[j]

    def step_tables(self, B: np.ndarray, d_units: np.ndarray) -> list[np.ndarray]:
        """Per model j, T_j[c, b, k'] flattened: the key term after routing.

        b = 0: the model is idle after this epoch (it was, or it just
        completed) and k' requests wait: it launches all of them when
        k' >= B_j of chain c.  b >= 1: it keeps running a batch of b with k'
        queued (its residual is added separately).  Entries with k' + b > N
        are never used.
        """
        N, nB = self.N, B.shape[0]
        kq = np.arange(N + 1)
        out = []
        for j in range(self.M):
            T = np.zeros((nB, N + 1, N + 1), dtype=np.int64)
            for b in range(1, N + 1):
                kk = kq[: N + 1 - b]
                T[:, b, : N + 1 - b] = self.code(j, kk, np.full_like(kk, b), 0)
            queued = self.code(j, kq, np.zeros_like(kq), 0)
            launched = self.code(j, np.zeros_like(kq), kq, d_units[j, kq])
            T[:, 0, :] = np.where(kq[None, :] >= B[:, j:j + 1], launched[None, :], queued[None, :])
            out.append(T.ravel())
        return out

    def decode(self, keys: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray],
                                                list[np.ndarray]]:
        """keys -> (chain, K, Bt, R) with per-model int32 columns."""
        def split(x: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:  # divmod for x >= 0
            q = x // d  # (np.divmod took twice as long as // with a multiply-subtract here)
            return q, x - q * d

        cid, rest = split(keys, self.space)
        K, Bt, R = [], [], []
        for j in range(self.M):
            rest, code = split(rest, self.radix[j]) if j < self.M - 1 else (None, rest)
            p, r = split(code, self.rrad[j])
            K.append(self.pk[p])
            Bt.append(self.pb[p])
            R.append(r.astype(np.int32))
        return cid.astype(np.int32), K, Bt, R


# -------------------- routing outcomes --------------------
# Routing outcomes of completing batches: multinomials and their convolutions.
#
# When several models complete at one epoch they all go idle and their requests
# are pooled in the queues, so only the SUM of their destination counts
# matters.  That convolved distribution is computed once per completion
# signature (b_i of each completing model, 0 elsewhere) and kept in one flat
# table that the vectorised BFS indexes into.


def compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write `total` as an ordered sum of `parts` non-negative ints, lexicographic."""
    if parts == 1:
        return [(total,)]
    return [(h,) + t for h in range(total + 1) for t in compositions(total - h, parts - 1)]


def multinomial_outcomes(b: int, p: np.ndarray) -> dict[tuple[int, ...], float]:
    """Destination counts of b requests routed with probabilities p."""
    support = [j for j in range(len(p)) if p[j] > 0]
    out: dict[tuple[int, ...], float] = {}
    for comp in compositions(b, len(support)):
        m = [0] * len(p)
        coef = math.factorial(b)
        pr = 1.0
        for j, c in zip(support, comp):
            m[j] = c
            coef //= math.factorial(c)
            pr *= float(p[j]) ** c
        out[tuple(m)] = coef * pr
    return out


class OutcomeTables:
    """Convolved routing outcomes per completion signature, in one flat table.

    A signature code (b_i in base N+1) maps to (offset, count) in the table;
    codes are looked up in dense arrays, and a code seen for the first time
    is convolved in Python once.
    """

    def __init__(self, P: np.ndarray, N: int) -> None:
        self.P, self.N, self.M = P, N, P.shape[0]
        self._single: dict[tuple[int, int], dict[tuple[int, ...], float]] = {}
        self._partial: dict[tuple[int, int], dict[tuple[int, ...], float]] = {}  # see _convolve
        ncode = (N + 1) ** self.M
        self.dense = ncode <= 1 << 22
        self._cnt = np.full(ncode if self.dense else 0, -1, dtype=np.int64)
        self._off = np.zeros(ncode if self.dense else 0, dtype=np.int64)
        self._where: dict[int, tuple[int, int]] = {}
        self.vecs = [np.zeros(0, dtype=np.int32) for _ in range(self.M)]
        self.probs = np.zeros(0)

    def _one(self, i: int, b: int) -> dict[tuple[int, ...], float]:
        if (i, b) not in self._single:
            self._single[(i, b)] = multinomial_outcomes(b, self.P[i])
        return self._single[(i, b)]

    def _convolve(self, code: int) -> tuple[list[tuple[int, ...]], list[float]]:
        dist: dict[tuple[int, ...], float] = {(0,) * self.M: 1.0}
        base, rest = self.N + 1, code
        for i in range(self.M):
            b, rest = rest % base, rest // base
            if b == 0:
                continue
            prefix = (i, code % base ** (i + 1))  # codes sharing models 0..i share this far
            if prefix not in self._partial:
                nxt: dict[tuple[int, ...], float] = {}
                for (u, pu), (v, pv) in itertools.product(dist.items(), self._one(i, b).items()):
                    w = tuple(x + y for x, y in zip(u, v))
                    nxt[w] = nxt.get(w, 0.0) + pu * pv
                self._partial[prefix] = nxt
            dist = self._partial[prefix]
        return list(dist.keys()), list(dist.values())

    def _add(self, codes: list[int]) -> None:
        vec_rows: list[tuple[int, ...]] = []
        pr: list[float] = []
        size = self.probs.size
        for c in codes:
            v, p = self._convolve(c)
            if self.dense:
                self._cnt[c], self._off[c] = len(p), size
            else:
                self._where[c] = (size, len(p))
            size += len(p)
            vec_rows += v
            pr += p
        V = np.array(vec_rows, dtype=np.int32).reshape(-1, self.M)
        self.vecs = [np.concatenate([self.vecs[j], V[:, j]]) for j in range(self.M)]
        self.probs = np.concatenate([self.probs, np.array(pr)])

    def lookup(self, code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row: (number of outcomes, offset of its outcomes in the table)."""
        if self.dense:
            cnt = self._cnt[code]
            if (cnt < 0).any():
                self._add(np.unique(code[cnt < 0]).tolist())
                cnt = self._cnt[code]
            return cnt, self._off[code]
        ucode, inv = np.unique(code, return_inverse=True)
        missing = [c for c in ucode.tolist() if c not in self._where]
        if missing:
            self._add(missing)
        oc = np.array([self._where[c] for c in ucode.tolist()], dtype=np.int64).reshape(-1, 2)
        return oc[inv, 1], oc[inv, 0]


# -------------------- breadth-first enumeration --------------------
# Breadth-first enumeration of the DTMC's reachable states, vectorised.
#
# A state is three small ints per model: k (queue), b (batch, 0 = idle) and r
# (residual, in units of the gcd of all batch durations).  Each BFS level
# expands the whole frontier at once:
#
# 1. tau = min residual of running models; the completing set A = argmin.
# 2. Completing models go idle and their requests are pooled in the queues, so
#    only the SUM of their multinomials matters; that convolved distribution
#    is tabulated once per "completion signature" (b_i for i in A, else 0).
# 3. Each state is repeated once per routing outcome and the targets' keys are
#    summed from per-model lookup tables (`Encoder`): the launch rule is in
#    the tables, so no target's fields are built.  Keys are looked up / added
#    in a hash table (`HashIndex`) and only new states are decoded.
#
# Several threshold vectors B are enumerated in one BFS (the chain index is part
# of the key): small chains are dominated by per-level numpy overhead, which a
# batch shares.  The BFS stops as soon as a chain passes `max_states`, or the
# batch passes its `budget` (the caller then splits the batch).  States keep
# BFS order (the solver picks its own order); chain c's start state is id c.
#
# With contention (models sharing hardware, `inputs.overlap`), a launch that overlaps another
# model's step lengthens both residuals: that part of a target's key depends on several models at
# once, so it is added to the table-built key as a per-transition correction.


class StateLimitError(ValueError):
    """The reachable state space is larger than the configured limit."""


class BudgetExceeded(Exception):
    """A multi-chain batch grew past its budget; split it and retry."""


@dataclass
class ChainBatch:
    """Reachable states of several chains (BFS order) and their transitions."""

    Bs: list[tuple[int, ...]]
    cid: np.ndarray  # (n,) chain of each state
    # K, Bt, R, tau, done: int16 (int32 if a residual or N passes 32766), values as computed.
    K: np.ndarray  # (n, M) post-launch queue lengths
    Bt: np.ndarray  # (n, M) running batch sizes, 0 = idle
    R: np.ndarray  # (n, M) residuals in units, 0 = idle
    tau: np.ndarray  # (n,) holding time in units
    done: np.ndarray  # (n, M) batch completing at the end of the hold (0 = none)
    counts: np.ndarray  # (n,) transitions out of each state; they are stored source by source
    # The transitions as the BFS made them, level by level: the sources of level l are the states
    # level_starts[l]:level_starts[l + 1], and dst_parts[l] / prob_parts[l] hold their transitions'
    # targets and probabilities, source by source.  `dst` and `prob` join them when asked (the
    # solver reads the parts: a joined copy is ~12 bytes per transition of fresh memory).
    dst_parts: list[np.ndarray]  # int32
    prob_parts: list[np.ndarray]  # float64
    level_starts: np.ndarray  # (levels + 1,)
    unit: int  # quanta per time unit
    rmax: np.ndarray  # (M,) largest residual each model can have, in units
    contended: bool = False  # residuals can grow (contention): see solve.solver_order

    @property
    def n(self) -> int:
        return self.K.shape[0]

    @property
    def nB(self) -> int:
        return len(self.Bs)

    @cached_property
    def dst(self) -> np.ndarray:  # (T,) targets, source by source
        return self.dst_parts[0] if len(self.dst_parts) == 1 else np.concatenate(self.dst_parts)

    @cached_property
    def prob(self) -> np.ndarray:  # (T,) probabilities, source by source
        return self.prob_parts[0] if len(self.prob_parts) == 1 else np.concatenate(self.prob_parts)

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


class SortedRuns:
    """(key, id) pairs in a few runs sorted by key, looked up with `np.searchsorted`; run sizes at
    least double from newest to oldest (a log-structured merge: two runs merge in one linear pass
    once the older is not twice the newer), so an insert costs O(its keys * log), not O(all)."""

    def __init__(self) -> None:
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []  # (sorted keys, their ids), oldest first
        self.size = 0

    def lookup(self, keys: np.ndarray, out: np.ndarray) -> None:
        """out[i] = id of keys[i] where present (keys sorted: `np.searchsorted` walks them in order)."""
        for rk, ri in self.runs:
            at = np.searchsorted(rk, keys)
            np.minimum(at, rk.shape[0] - 1, out=at)
            hit = rk[at] == keys
            out[hit] = ri[at[hit]]

    def insert(self, keys: np.ndarray, ids: np.ndarray) -> None:
        """Add distinct sorted keys known to be absent, with their ids."""
        self.size += keys.shape[0]
        self.runs.append((keys, ids))
        while len(self.runs) > 1 and self.runs[-2][0].shape[0] < 2 * self.runs[-1][0].shape[0]:
            (ak, ai), (bk, bi) = self.runs[-2], self.runs.pop()
            pos = np.searchsorted(ak, bk) + np.arange(bk.shape[0])  # b's places in the merged run
            mk, mi = np.empty(ak.shape[0] + bk.shape[0], np.int64), np.empty(ak.shape[0] + bk.shape[0], np.int64)
            rest = np.ones(mk.shape[0], bool)
            rest[pos] = False
            mk[pos], mi[pos], mk[rest], mi[rest] = bk, bi, ak, ai
            self.runs[-1] = (mk, mi)


class HashIndex:
    """Dense ids 0, 1, 2, ... of packed state keys in insertion order.

    A direct-mapped table, at least 4 slots per key, holds each key's id in the key's slot (the
    top bits of key * 2^64 / golden ratio); `keys` holds the keys by id.  A key whose slot was
    taken when it came goes to an overflow of sorted runs (`SortedRuns`, ~10 % of the keys).
    A lookup is two gathers for the whole array (the slot's id, that id's key); only the keys
    whose slot holds another key search the overflow, and a key whose slot is empty is surely
    absent.  Doubling the table sends slot h to 2h or 2h + 1, so the keys in it never collide
    there; the overflow then tries its slots again.

    Kept by hand: numpy and scipy have no hash map, only sorts.  It replaced `SortedIndex` (each
    BFS level's keys made unique with `np.unique(return_inverse=True)`, then looked up in the
    sorted runs alone).  The index work on the recorded key streams of the 3-model case (2-core
    Xeon, quiet, 2026-12-05, CPU seconds, three runs each, same ids): all 21 BFS batches of N = 7
    (54M transitions) 3.73-3.85 s with the sorted runs, 2.46-2.53 s with this table (1.5x); its
    largest N = 8 chain alone (1.48M states, 11.1M transitions) 0.69-0.77 s against 0.54-0.66 s
    (1.15-1.3x: the table outgrows the caches).  Tried and dropped: open addressing with linear
    probing, probed for the whole array a step per round (slower than the runs: tens of rounds
    per level), (key, id) rows side by side (4x the memory, no faster), and a second slot per key
    (a seventh of the overflow, no faster).
    """

    MULT = np.uint64(0x9E3779B97F4A7C15)  # odd
    LOAD_SHIFT = 2  # the table has at least 2**LOAD_SHIFT slots per key

    def __init__(self, bits: int = 14) -> None:
        self.size = 0
        self.keys = np.empty(1 << 12, dtype=np.int64)  # keys by id (the first `size`)
        self.over = SortedRuns()
        self._alloc(bits)

    def _alloc(self, bits: int) -> None:
        self.bits = bits
        self.table = np.full(1 << bits, -1, dtype=np.int32)  # id per slot; -1: empty

    def _home(self, keys: np.ndarray) -> np.ndarray:
        h = keys.view(np.uint64) * self.MULT
        h >>= np.uint64(64 - self.bits)
        return h.view(np.int64)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Ids (int32) of `keys` (int64, any order, repeats allowed), -1 where absent."""
        ids = self.table[self._home(keys)]
        taken = ids >= 0
        hit = self.keys.take(ids, mode="clip") == keys  # (an empty slot's -1 clips to id 0)
        hit &= taken
        out = np.where(hit, ids, -1)
        if self.over.size:
            other = np.flatnonzero(taken & ~hit)  # the slot holds another key
            if other.size:
                q = keys[other]
                srt = np.argsort(q)
                got = np.full(q.shape[0], -1, dtype=np.int32)
                self.over.lookup(q[srt], got)
                out[other[srt]] = got
        return out

    def _place(self, keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Put ids in their keys' empty slots; -> mask of the keys that found theirs taken.  Keys
        racing for one slot: whichever write lands stays, the others are refused."""
        h = self._home(keys)
        c = np.flatnonzero(self.table[h] < 0)
        hc = h[c]
        self.table[hc] = ids[c]
        won = self.table[hc] == ids[c]
        refused = np.ones(keys.shape[0], dtype=bool)
        refused[c[won]] = False
        return refused

    def insert_new(self, keys: np.ndarray) -> np.ndarray:
        """Insert distinct sorted keys known to be absent (as np.unique returns them); return their
        new ids."""
        n0, n = self.size, keys.shape[0]
        ids = np.arange(n0, n0 + n, dtype=np.int64)
        self.size += n
        if self.size > self.keys.shape[0]:
            grown = np.empty(max(2 * self.keys.shape[0], self.size), dtype=np.int64)
            grown[:n0] = self.keys[:n0]
            self.keys = grown
        self.keys[n0:self.size] = keys
        if self.size << self.LOAD_SHIFT > self.table.shape[0]:
            self._grow(n0)
        refused = self._place(keys, ids)
        if refused.any():
            self.over.insert(keys[refused], ids[refused])  # a subset of sorted keys stays sorted
        return ids

    def _grow(self, n0: int) -> None:
        """A larger table for ids 0..n0-1 (those already in: in the table or the overflow)."""
        bits = self.bits
        while self.size << self.LOAD_SHIFT > 1 << bits:
            bits += 1
        self._alloc(bits)
        placed = np.ones(n0, dtype=bool)
        for _, ids in self.over.runs:
            placed[ids] = False
        placed = np.flatnonzero(placed)
        self.table[self._home(self.keys[placed])] = placed  # distinct old slots: distinct new ones
        if self.over.size:
            ids = np.concatenate([i for _, i in self.over.runs])
            keys = self.keys[ids]
            srt = np.argsort(keys)
            keys, ids = keys[srt], ids[srt]
            refused = self._place(keys, ids)
            self.over = SortedRuns()
            if refused.any():
                self.over.insert(keys[refused], ids[refused])


def enumerate_chains(
    P: np.ndarray,
    d_units: np.ndarray,
    unit: int,
    N: int,
    Bs: Sequence[tuple[int, ...]],
    max_states: int,
    budget: int | None = None,
    kappa: np.ndarray | None = None,
    rmax: np.ndarray | None = None,
) -> ChainBatch:
    """BFS from the start state of every B in Bs at once.

    `kappa` (M, M, N+1, N+1): contention (`inputs.Contention.table`), with `rmax` the
    residual bound per model in units (`inputs.residual_bound`).
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
    index = HashIndex()
    index.insert_new(keys0)
    cid, K, Bt, R = enc.decode(keys0)
    per_chain = np.ones(nB, dtype=np.int64)

    # Per level: the frontier's fields (K, Bt, R, done: a list of M columns) and its transitions.
    lv: dict[str, list] = {k: [] for k in ("cid", "tau", "counts", "K", "Bt", "R", "done", "dst", "prob")}
    while cid.shape[0]:
        run = [Bt[i] > 0 for i in range(M)]
        tau = np.where(run[0], R[0], big)
        for i in range(1, M):
            np.minimum(tau, np.where(run[i], R[i], big), out=tau)
        comp = [run[i] & (R[i] == tau) for i in range(M)]
        done = [np.where(comp[i], Bt[i], 0) for i in range(M)]
        sig = done[0].astype(np.int64)
        for i in range(1, M):
            sig += done[i] * np.int64((N + 1) ** i)
        cnt, off = tables.lookup(sig)
        # Transition t leaves source src[t]; its outcome index runs off[s], off[s] + 1, ... per
        # source s.  One np.repeat, then gathers by src: np.repeat with counts copies element by
        # element, ~2x slower than a gather per transition.
        src = np.repeat(np.arange(cnt.shape[0]), cnt)
        flat = (off - (np.cumsum(cnt) - cnt))[src]
        flat += np.arange(src.shape[0])
        # Key = part fixed by the source (chain, residuals of models still
        # running) + per model a table entry picked by (source, outcome).
        fixed = cid * space  # (int32 * int64 scalar: int64)
        for i in range(M):
            keep = run[i] ^ comp[i]  # still running after this epoch (comp implies run)
            fixed += np.where(keep, R[i] - tau, 0) * np.int64(enc.stride[i])
        keys = fixed[src]
        row0 = cid * np.int64(width)
        for i in range(M):
            row = row0 + np.where(comp[i], 0, Bt[i]) * (N + 1) + K[i]
            keys += steps[i][row[src] + tables.vecs[i][flat]]
        prob = tables.probs[flat]
        if kappa is not None:
            keys, prob, cnt = _charge_overlaps(keys, prob, cnt, cid, K, Bt, R, comp, tau, flat, tables,
                                               Barr, d_units, kappa, order, rmax, enc.stride)
        for name, arr in (("cid", cid), ("tau", tau), ("counts", cnt)):
            lv[name].append(arr)
        for name, cols in (("K", K), ("Bt", Bt), ("R", R), ("done", done)):
            lv[name].append(cols)
        # Every transition's target is looked up as it is; only the keys not found are sorted
        # (new states get ids in key order, level by level).
        ids = index.lookup(keys)
        miss = np.flatnonzero(ids < 0)
        if miss.size:
            nk, inv = np.unique(keys[miss], return_inverse=True)
            ncid, nK, nBt, nR = enc.decode(nk)  # the next frontier, once the limits pass
            per_chain += np.bincount(ncid, minlength=nB)
            worst = int(per_chain.argmax())
            if per_chain[worst] > max_states:
                raise StateLimitError(
                    f"state space exceeds max_states = {max_states:,} for N = {N}, "
                    f"B = {tuple(Bs[worst])}; use a coarser delta (fewer quanta per step) "
                    "or raise max_states"
                )
            if budget is not None and nB > 1 and index.size + nk.size > budget:
                raise BudgetExceeded()
            ids[miss] = index.insert_new(nk)[inv]
            cid, K, Bt, R = ncid, nK, nBt, nR
        else:
            cid = cid[:0]
        lv["dst"].append(ids)
        lv["prob"].append(prob)

    dst, prob = lv.pop("dst"), lv.pop("prob")
    level_starts = np.concatenate([[0], np.cumsum([c.shape[0] for c in lv["cid"]])])
    n = int(level_starts[-1])
    # The per-state fields (queues, batches, residuals, holds) are small numbers: int16 where they
    # fit, half the memory of the int32 the levels computed in (the 3-model case's largest chain,
    # 1.48M states: solver_order 81 ms against 111-143 ms).
    small = np.int16 if max(int(rmax.max()), N) < np.iinfo(np.int16).max else np.int32
    cat = {"tau": np.concatenate(lv.pop("tau"), out=np.empty(n, dtype=small))}
    for name in ("K", "Bt", "R", "done"):  # (n, M) arrays, each column joined in place
        levels, cat[name] = lv.pop(name), np.empty((n, M), dtype=small)
        for i in range(M):
            np.concatenate([cols[i] for cols in levels], out=cat[name][:, i])
    cat.update({k: (v[0] if len(v) == 1 else np.concatenate(v)) for k, v in lv.items()})
    return ChainBatch(Bs=[tuple(int(x) for x in b) for b in Bs], unit=unit, rmax=rmax,
                      contended=kappa is not None, dst_parts=dst, prob_parts=prob, level_starts=level_starts,
                      **cat)


def _charge_overlaps(keys, prob, cnt, cid, K, Bt, R, comp, tau, flat, tables, Barr, d_units, kappa, order,
                     rmax, stride) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Charge this epoch's overlaps (`inputs.overlap`) into the targets' keys.

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
