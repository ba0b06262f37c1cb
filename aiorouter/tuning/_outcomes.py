"""Routing outcomes of completing batches: multinomials and their convolutions.

When several models complete at one epoch they all go idle and their requests
are pooled in the queues, so only the SUM of their destination counts
matters.  That convolved distribution is computed once per completion
signature (b_i of each completing model, 0 elsewhere) and kept in one flat
table that the vectorised BFS indexes into.
"""

from __future__ import annotations

import itertools
import math

import numpy as np


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(total,)]
    return [(h,) + t for h in range(total + 1) for t in _compositions(total - h, parts - 1)]


def multinomial_outcomes(b: int, p: np.ndarray) -> dict[tuple[int, ...], float]:
    """Destination counts of b requests routed with probabilities p."""
    support = [j for j in range(len(p)) if p[j] > 0]
    out: dict[tuple[int, ...], float] = {}
    for comp in _compositions(b, len(support)):
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
        for i in range(self.M):
            b, code = code % (self.N + 1), code // (self.N + 1)
            if b == 0:
                continue
            nxt: dict[tuple[int, ...], float] = {}
            for (u, pu), (v, pv) in itertools.product(dist.items(), self._one(i, b).items()):
                w = tuple(x + y for x, y in zip(u, v))
                nxt[w] = nxt.get(w, 0.0) + pu * pv
            dist = nxt
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
