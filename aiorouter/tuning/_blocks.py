"""The F/Y block structure of the chain used by the stationary solver.

F (feedback states): the highest-ranked running model (slowest first) has
just launched.  Every cycle passes through F, so the other states Y form a
DAG; ordering Y by the residual vector in rank order, lexicographically
descending, makes (I - T_YY) unit lower triangular.  See `_solver`.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spl

from ._statespace import ChainBatch


class SolverError(RuntimeError):
    pass


class UnitLowerSolver:
    """x = L^-1 b for a sparse unit lower-triangular L (the DAG part).

    SuperLU's triangular kernel (gstrs) is called directly with L as the
    "L factor" and an empty U, as scipy's own spsolve_triangular does, but
    without its per-call copies.  gstrs is private scipy API, so if it is
    missing we fall back to splu in natural order (which re-"factorises" the
    already triangular matrix once: correct, only slower).
    """

    def __init__(self, L: sp.csc_matrix) -> None:
        self.n = L.shape[0]
        self.L = L
        self._lu = None
        try:
            from scipy.sparse.linalg._dsolve import _superlu

            self._gstrs = _superlu.gstrs
            self._Li = L.indices.astype(np.intc)
            self._Lp = L.indptr.astype(np.intc)
            self._U = sp.csc_matrix((self.n, self.n))
            self._Ui = self._U.indices.astype(np.intc)
            self._Up = self._U.indptr.astype(np.intc)
            probe = np.linspace(1.0, 2.0, self.n)
            x = self.solve(probe)
            if not np.allclose(L @ x, probe, rtol=1e-9, atol=1e-9):
                raise RuntimeError("gstrs self-check failed")
        except Exception:  # any API drift: use the public path
            self._gstrs = None
            self._lu = spl.splu(L, permc_spec="NATURAL", diag_pivot_thresh=0.0,
                                options=dict(SymmetricMode=True))

    def solve(self, b: np.ndarray) -> np.ndarray:
        if self._gstrs is None:
            return self._lu.solve(b)
        x, info = self._gstrs("N", self.n, self.L.nnz, self.L.data, self._Li, self._Lp,
                              self.n, 0, self._U.data, self._Ui, self._Up,
                              np.array(b, dtype=float, copy=True))
        if info:
            raise SolverError(f"triangular solve failed (info={info})")
        return x


def f_y_blocks(cb: ChainBatch, pos: np.ndarray, nF: int):
    """The four F/Y blocks of T^T, as CSC matrices, plus L = I - T_YY^T.

    No sorting: the BFS emits transitions grouped by source in id order, so
    T is already CSR by source, i.e. T^T is CSC by source.  Reordering the
    sources is a segment gather; splitting by destination (F or Y) is a mask
    and a cumulative count.  Everything is O(nnz).
    """
    n = cb.n
    nY = n - nF
    order = np.argsort(pos)  # inverse permutation
    if cb.src.size > 1 and np.any(cb.src[1:] < cb.src[:-1]):
        raise SolverError("transitions must be grouped by source in id order")
    counts = np.bincount(cb.src, minlength=n)
    indptr = np.concatenate([[0], np.cumsum(counts)])

    def by_source(ids: np.ndarray):
        c = counts[ids]
        ip = np.concatenate([[0], np.cumsum(c)])
        it = np.int32 if ip[-1] < 2**31 else np.int64
        take = np.repeat((indptr[ids] - ip[:-1]).astype(it), c) + np.arange(ip[-1], dtype=it)
        return ip, pos[cb.dst[take]], cb.prob[take]

    def split(ip: np.ndarray, dst: np.ndarray, data: np.ndarray, ncols: int):
        to_f = dst < nF
        before = np.concatenate([[0], np.cumsum(to_f)])[ip]  # F entries before each column
        A_f = sp.csc_matrix((data[to_f], dst[to_f], before), shape=(nF, ncols))
        to_y = ~to_f
        A_y = sp.csc_matrix((data[to_y], dst[to_y] - nF, ip - before), shape=(nY, ncols))
        return A_f, A_y

    A_FF, A_YF = split(*by_source(order[:nF]), nF)  # sources in F
    A_FY, A_YY = split(*by_source(order[nF:]), nY)  # sources in Y
    # L = I - A_YY with the unit diagonal stored FIRST in every column: Y -> Y
    # edges go strictly forward, so all other rows are below it (SuperLU's
    # triangular kernel needs the diagonal first, the rest in any order).
    ip = A_YY.indptr + np.arange(nY + 1)
    diag = ip[:-1]
    off = np.ones(ip[-1], dtype=bool)
    off[diag] = False
    idx = np.empty(ip[-1], dtype=np.int32)
    val = np.empty(ip[-1])
    idx[diag], val[diag] = np.arange(nY), 1.0
    idx[off], val[off] = A_YY.indices, -A_YY.data
    L = sp.csc_matrix((val, idx, ip), shape=(nY, nY))
    return A_FF, A_YF, A_FY, L


def feedback_order(Bt: np.ndarray, R: np.ndarray, d_units: np.ndarray) -> tuple[np.ndarray, int]:
    """Return (order, nF): state ids with F first, then Y topologically."""
    n, M = Bt.shape
    rank = np.argsort(-d_units.max(axis=1), kind="stable")
    Rr, Br = R[:, rank], Bt[:, rank]
    top = np.argmax(Br > 0, axis=1)
    rows = np.arange(n)
    is_f = Rr[rows, top] == d_units[rank[top], Br[rows, top]]
    # Lexicographic residual key in rank order, packed into one int64.
    key = np.zeros(n, dtype=np.int64)
    for j in range(M):
        key = key * (int(d_units[rank[j]].max()) + 1) + Rr[:, j]
    f_ids = np.flatnonzero(is_f)
    y_ids = np.flatnonzero(~is_f)
    order = np.concatenate([f_ids, y_ids[np.argsort(-key[y_ids], kind="stable")]])
    return order, f_ids.size
