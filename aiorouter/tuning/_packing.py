"""Injective int64 keys for DTMC states, linear per model so the BFS can build them.

A model's fields (k, b, r) get one code: the index of the pair (k, b) among
the pairs with k + b <= N (about half of (N+1)^2), times (rmax + 1), plus r.
A state's key is sum_j code_j * stride_j (mixed radix over models), plus
chain * space when several chains share one BFS.  Because the key is a SUM of
per-model terms, the BFS gets a target's key from small lookup tables
(`step_tables`) without materialising the target's fields; only states seen
for the first time are decoded.
"""

from __future__ import annotations

import math

import numpy as np

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
        cid, rest = np.divmod(keys, self.space)
        K, Bt, R = [], [], []
        for j in range(self.M):
            rest, code = np.divmod(rest, self.radix[j]) if j < self.M - 1 else (None, rest)
            p, r = np.divmod(code, self.rrad[j])
            K.append(self.pk[p])
            Bt.append(self.pb[p])
            R.append(r.astype(np.int32))
        return cid.astype(np.int32), K, Bt, R
