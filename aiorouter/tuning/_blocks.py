"""The F/Y block structure of the chain used by the stationary solver.

F (feedback states): the highest-ranked running model (slowest first) has
just launched.  Every cycle passes through F, so the other states Y form a
DAG; ordering Y by the residual vector in rank order, lexicographically
descending, makes every Y -> Y transition go forward.  See `_solver`.
With contention F also takes every state entered by a step that does not
descend in that order (`solver_order`).

Solver order is [Y in that order, then F chain by chain].  With it, applying
the chain censored to F is one matrix-vector product and ONE unit lower
triangular solve over all n states:

    [ I - T_YY^T   0 ] [z_Y]   [T_YF^T v]          z_F = T_FF^T v + T_FY^T z_Y
    [  -T_FY^T     I ] [z_F] = [T_FF^T v]   gives       = S^T v,

where the right-hand side is T^T restricted to F's columns.  The matrix on
the left is just the Y sources' columns of I - T^T (whatever their
destinations) plus unit columns for F, so building it needs no split of the
transitions by destination: one gather of each source's run, in order.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spl

from ._statespace import ChainBatch


class SolverError(RuntimeError):
    pass


_GSTRS_OK: bool | None = None  # SuperLU's private triangular kernel checked once per process


class UnitLowerSolver:
    """x = L^-1 b for a sparse unit lower-triangular L, diagonal first in each column.

    SuperLU's triangular kernel (gstrs) is called directly with L as the
    "L factor" and an empty U, as scipy's own spsolve_triangular does, but
    without its per-call copies.  gstrs is private scipy API, so it is
    self-checked once; if that fails we fall back to splu in natural order
    (which re-"factorises" the already triangular matrix: correct, slower).
    """

    def __init__(self, data: np.ndarray, indices: np.ndarray, indptr: np.ndarray) -> None:
        global _GSTRS_OK
        self.n = indptr.size - 1
        self.data = data
        self.indices = indices.astype(np.intc, copy=False)
        self.indptr = indptr.astype(np.intc, copy=False)
        self._U = [np.zeros(0), np.zeros(0, dtype=np.intc), np.zeros(self.n + 1, dtype=np.intc)]
        if _GSTRS_OK is None:
            _GSTRS_OK = _check_gstrs()
        self._lu = None
        if not _GSTRS_OK:
            L = sp.csc_matrix((data, indices, indptr), shape=(self.n, self.n))
            self._lu = spl.splu(L, permc_spec="NATURAL", diag_pivot_thresh=0.0,
                                options=dict(SymmetricMode=True))

    def solve(self, b: np.ndarray) -> np.ndarray:
        """Solves in place when b is a float64 array (the callers pass temporaries)."""
        if self._lu is not None:
            return self._lu.solve(b)
        from scipy.sparse.linalg._dsolve import _superlu

        x, info = _superlu.gstrs("N", self.n, self.data.size, self.data, self.indices, self.indptr,
                                 self.n, 0, *self._U, np.asarray(b, dtype=float))
        if info:
            raise SolverError(f"triangular solve failed (info={info})")
        return x


def _check_gstrs() -> bool:
    try:
        from scipy.sparse.linalg._dsolve import _superlu

        rng = np.random.default_rng(0)
        n = 50
        L = sp.tril(sp.random(n, n, density=0.2, random_state=1), k=-1).tocsc() * -0.3
        L = (L + sp.identity(n, format="csc")).tocsc()
        b = rng.random(n)
        U = [np.zeros(0), np.zeros(0, dtype=np.intc), np.zeros(n + 1, dtype=np.intc)]
        # Diagonal first in each column, as we build ours.
        order = np.lexsort((L.indices != np.repeat(np.arange(n), np.diff(L.indptr)),
                            np.repeat(np.arange(n), np.diff(L.indptr))))
        x, info = _superlu.gstrs("N", n, L.nnz, L.data[order].copy(), L.indices[order].astype(np.intc),
                                 L.indptr.astype(np.intc), n, 0, *U, b.copy())
        return info == 0 and bool(np.allclose(L @ x, b, rtol=1e-10, atol=1e-12))
    except Exception:  # any API drift: use the public path
        return False


def solver_order(cb: ChainBatch, d_units: np.ndarray) -> tuple[np.ndarray, int]:
    """Return (order, nY): state ids with Y first (topologically), then F by chain."""
    n, M = cb.Bt.shape
    rank = np.argsort(-d_units.max(axis=1), kind="stable")
    Rr, Br = cb.R[:, rank], cb.Bt[:, rank]
    top = np.argmax(Br > 0, axis=1)
    rows = np.arange(n)
    is_f = Rr[rows, top] == d_units[rank[top], Br[rows, top]]
    # Lexicographic residual key in rank order, packed into one int64.
    key = np.zeros(n, dtype=np.int64)
    for j in range(M):
        key = key * (int(cb.rmax[rank[j]]) + 1) + Rr[:, j]
    if cb.contended:
        # A launch can lengthen a running model's residual, so a Y -> Y step could climb the key.
        # Any state entered by a step that does not descend joins F: Y stays a DAG (every
        # transition into Y descends), and the F above is kept (the start states are in it).
        up = key[cb.dst] >= key[cb.src]
        is_f[cb.dst[up]] = True
    f_ids = np.flatnonzero(is_f)
    y_ids = np.flatnonzero(~is_f)
    f_ids = f_ids[np.argsort(cb.cid[f_ids], kind="stable")]
    # Y -> Y lowers the key strictly (the top model's residual drops, or it
    # completes and idles; relaunching would make the target F), so ties may
    # fall in any order: the unstable sort is ~2x faster than the stable one.
    return np.concatenate([y_ids[np.argsort(-key[y_ids])], f_ids]), y_ids.size


def solver_blocks(cb: ChainBatch, order: np.ndarray, pos: np.ndarray, nY: int
                  ) -> tuple[UnitLowerSolver, sp.csc_matrix]:
    """The lower-triangular system above, and T^T's F-source columns (n x nF)."""
    n, T = cb.n, cb.dst.size
    ptr, counts = cb.indptr, cb.counts.astype(np.intp)

    def runs(ids: np.ndarray, c: np.ndarray, lead: int) -> tuple[np.ndarray, np.ndarray]:
        # Indices into dst/prob of the first c - lead transitions of each
        # source in ids, in that order, after `lead` free slots each.  intp:
        # numpy converts any other index dtype to it, a pass per gather.
        ip = np.zeros(ids.size + 1, dtype=np.intp)
        np.cumsum(c, out=ip[1:])
        take = np.repeat(ptr[ids] - ip[:-1] - lead, c)
        take += np.arange(ip[-1], dtype=np.intp)
        return ip, take

    # Columns of the triangular matrix, one per state: its unit diagonal
    # first (SuperLU's kernel wants it first; taken from the self-id tail of
    # dst_ext), then for a Y source its transitions.  F columns: diagonal only.
    c = counts[order] + 1
    c[nY:] = 1
    ip, take = runs(order, c, 1)
    take[ip[:-1]] = T + order
    data = cb.prob_ext[take]
    np.negative(data, out=data)  # I - T^T; the tail's -1 becomes the diagonal's +1
    lower = UnitLowerSolver(data, pos[cb.dst_ext[take]], ip)
    ipF, takeF = runs(order[nY:], counts[order[nY:]], 0)
    A_F = sp.csc_matrix((cb.prob[takeF], pos[cb.dst[takeF]], ipF), shape=(n, n - nY))
    return lower, A_F
