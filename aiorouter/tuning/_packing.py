"""Injective int64 keys for DTMC states (so a hash map can deduplicate them)."""

from __future__ import annotations

import math

import numpy as np


class KeySpaceError(ValueError):
    """The packed state key would not fit in 62 bits."""


class Packer:
    """Injective int64 key of a state (per-model columns k, b, r).

    Mixed radix over every field when that fits; otherwise the rank of the
    (k, b) composition (they sum to N) times a residual radix.
    """

    def __init__(self, M: int, N: int, rmax: np.ndarray) -> None:
        self.M, self.N = M, N
        radix = [int(v) + 1 for v in rmax]
        self.rstride = [math.prod(radix[:i]) for i in range(M)]
        self.rspace = math.prod(radix)
        plain = (N + 1) ** (2 * M) * self.rspace
        self.ranked = plain >= 2**40
        if not self.ranked:
            # key = sum_i k_i s_k[i] + b_i s_b[i] + r_i * rstride[i]
            self.kstride = [self.rspace * (N + 1) ** (2 * i) for i in range(M)]
            self.bstride = [self.rspace * (N + 1) ** (2 * i + 1) for i in range(M)]
            self.space = plain
            return
        n = 2 * M
        cnt = [[math.comb(s + p - 1, p - 1) if p else 0 for s in range(N + 1)] for p in range(n + 1)]
        S = np.zeros((n - 1, N + 1, N + 1), dtype=np.int64)
        for j in range(n - 1):
            for rem in range(N + 1):
                acc = 0
                for x in range(rem + 1):
                    S[j, rem, x] = acc
                    acc += cnt[n - j - 1][rem - x]
        self.S = S
        self.space = cnt[n][N] * self.rspace
        if self.space >= 2**62:
            raise KeySpaceError(
                f"state encoding needs more than 62 bits (M = {M}, N = {N}); "
                "use a coarser delta or fewer models"
            )

    def keys(self, K: list[np.ndarray], Bt: list[np.ndarray], R: list[np.ndarray]) -> np.ndarray:
        if not self.ranked:
            key = R[0].astype(np.int64)
            for i in range(self.M):
                if i:
                    key += R[i].astype(np.int64) * self.rstride[i]
                key += K[i].astype(np.int64) * self.kstride[i]
                key += Bt[i].astype(np.int64) * self.bstride[i]
            return key
        rank = np.zeros(K[0].shape[0], dtype=np.int64)
        rem = np.full(K[0].shape[0], self.N, dtype=np.int64)
        for j, x in enumerate(K + Bt[:-1]):
            rank += self.S[j, rem, x]
            rem -= x
        res = R[0].astype(np.int64)
        for i in range(1, self.M):
            res += R[i].astype(np.int64) * self.rstride[i]
        return rank * np.int64(self.rspace) + res
