"""The chain's solution: the stationary distribution of a batch of chains (censored to the feedback
states, solved by per-chain GMRES over one triangular solve), with its fallbacks and the check
that it is the one the start state leads to.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import breadth_first_order, connected_components
import scipy.sparse.linalg as spl

from .statespace import ChainBatch

# -------------------- the F/Y blocks --------------------
# The F/Y block structure of the chain used by the stationary solver.
#
# F (feedback states): the highest-ranked running model (slowest first) has
# just launched.  Every cycle passes through F, so the other states Y form a
# DAG; ordering Y by the residual vector in rank order, lexicographically
# descending, makes every Y -> Y transition go forward.  See `stationary_batch`.
# With contention F also takes every state entered by a step that does not
# descend in that order (`solver_order`).
#
# Solver order is [Y in that order, then F chain by chain].  With it, applying
# the chain censored to F is one matrix-vector product and ONE unit lower
# triangular solve over all n states:
#
#     [ I - T_YY^T   0 ] [z_Y]   [T_YF^T v]          z_F = T_FF^T v + T_FY^T z_Y
#     [  -T_FY^T     I ] [z_F] = [T_FF^T v]   gives       = S^T v,
#
# where the right-hand side is T^T restricted to F's columns.  The matrix on
# the left is just the Y sources' columns of I - T^T (whatever their
# destinations) plus unit columns for F, so building it needs no split of the
# transitions by destination: one gather of each source's run, in order.


class SolverError(RuntimeError):
    """A chain's stationary distribution could not be computed to the tolerance."""


class UnitLowerSolver:
    """x = L^-1 b for a sparse unit lower-triangular L, diagonal first in each column: the solve
    for chains without levels (contention), or where the level kernel is missing (`LevelSolver`).

    SuperLU's triangular kernel (gstrs) is called directly with L as the "L factor" and an empty
    U, as scipy's own `spsolve_triangular` does, but without its per-call copies.  Measured on the
    router's start-up solves (2-core AMD EPYC AVX2, 2026-12-04; seconds in this class, building
    plus solving, two runs): the paper pair (M = 2, N <= 16) 1.84 / 2.07 s with gstrs, 2.85 /
    3.81 s with `splu` in natural order (it re-factorises the already triangular matrix: 1.5-1.8x),
    12.6 / 11.6 s with `spsolve_triangular` (6x); the 3-model case (N <= 8) 3.31 / 3.12 s, 6.44 /
    6.89 s (1.9-2.2x) and 19.0 / 23.7 s (6-7x).  gstrs is private scipy API, so each solver checks
    it on a small system first (microseconds) and otherwise uses `splu`.
    """

    def __init__(self, data: np.ndarray, indices: np.ndarray, indptr: np.ndarray) -> None:
        self.n = indptr.size - 1
        self.data = data
        self.indices = indices.astype(np.intc, copy=False)
        self.indptr = indptr.astype(np.intc, copy=False)
        self._U = _empty_u(self.n)
        self._gstrs = gstrs_kernel()
        self._lu = None
        if self._gstrs is None:
            L = sp.csc_matrix((data, indices, indptr), shape=(self.n, self.n))
            self._lu = spl.splu(L, permc_spec="NATURAL", diag_pivot_thresh=0.0,
                                options=dict(SymmetricMode=True))

    def solve(self, b: np.ndarray) -> np.ndarray:
        """Solves in place when b is a float64 array (the callers pass temporaries)."""
        if self._lu is not None:
            return self._lu.solve(b)
        x, info = self._gstrs("N", self.n, self.data.size, self.data, self.indices, self.indptr,
                              self.n, 0, *self._U, np.asarray(b, dtype=float))
        if info:
            raise SolverError(f"triangular solve failed (info={info})")
        return x


def _empty_u(n: int) -> list[np.ndarray]:
    return [np.zeros(0), np.zeros(0, dtype=np.intc), np.zeros(n + 1, dtype=np.intc)]


def gstrs_kernel():
    """SuperLU's triangular solve if it solves a small unit lower system right, else None."""
    try:
        from scipy.sparse.linalg._dsolve import _superlu

        # L = [[1, 0, 0], [-0.5, 1, 0], [-0.25, -0.5, 1]] by columns, diagonal first.
        data = np.array([1.0, -0.5, -0.25, 1.0, -0.5, 1.0])
        indices = np.array([0, 1, 2, 1, 2, 2], dtype=np.intc)
        indptr = np.array([0, 3, 5, 6], dtype=np.intc)
        x, info = _superlu.gstrs("N", 3, 6, data, indices, indptr, 3, 0, *_empty_u(3),
                                 np.array([1.0, 1.0, 1.0]))
        ok = info == 0 and np.allclose(x, [1.0, 1.5, 2.0], rtol=1e-12)
        return _superlu.gstrs if ok else None
    except Exception:  # any API drift: the public path
        return None


def solver_order(cb: ChainBatch, d_units: np.ndarray) -> tuple[np.ndarray, int, np.ndarray | None]:
    """Return (order, nY, levels): state ids with Y first (topologically), then F by chain; and,
    without contention, Y's levels (positions levels[i]:levels[i + 1] have no transition between
    them), else None."""
    n = cb.n
    rank = [int(i) for i in np.argsort(-d_units.max(axis=1), kind="stable")]
    # The top model: the first running one in rank order (the first in rank order if none runs).
    top_m = np.full(n, rank[0])
    top_r, top_b = cb.R[:, rank[0]], cb.Bt[:, rank[0]]
    for i in reversed(rank):  # the first running model in rank order is written last
        on = cb.Bt[:, i] > 0
        top_m = np.where(on, i, top_m)
        top_r = np.where(on, cb.R[:, i], top_r)
        top_b = np.where(on, cb.Bt[:, i], top_b)
    is_f = top_r == d_units[top_m, top_b]
    # Lexicographic residual key in rank order, packed into one int64.
    key = np.zeros(n, dtype=np.int64)
    for i in rank:
        key = key * (int(cb.rmax[i]) + 1) + cb.R[:, i]
    if cb.contended:
        # A launch can lengthen a running model's residual, so a Y -> Y step could climb the key.
        # Any state entered by a step that does not descend joins F: Y stays a DAG (every
        # transition into Y descends), and the F above is kept (the start states are in it).
        up = key[cb.dst] >= key[cb.src]
        is_f[cb.dst[up]] = True
    f_ids = np.flatnonzero(is_f)
    y_ids = np.flatnonzero(~is_f)
    if cb.nB > 1:
        f_ids = f_ids[np.argsort(cb.cid[f_ids], kind="stable")]
    # Y -> Y lowers the key strictly (the top model's residual drops, or it
    # completes and idles; relaunching would make the target F), so ties may
    # fall in any order: the unstable sort is ~2x faster than the stable one.
    y_ids = y_ids[np.argsort(-key[y_ids])]
    levels = None
    if not cb.contended:
        # In that order, (the top model's place in rank order, minus its residual) never falls,
        # and without contention every Y -> Y step raises it (the top model's residual drops by
        # the step, or the top model idles and a later-ranked one is on top): its runs are
        # levels with no transition inside one.  `solver_blocks` checks that before using them.
        place = np.empty(len(rank), dtype=np.int64)
        place[rank] = np.arange(len(rank))
        level = place[top_m[y_ids]] * (int(cb.rmax.max()) + 1) - top_r[y_ids]
        levels = np.concatenate([[0], np.flatnonzero(np.diff(level)) + 1, [y_ids.size]])
    return np.concatenate([y_ids, f_ids]), y_ids.size, levels


def solver_blocks(cb: ChainBatch, order: np.ndarray, pos: np.ndarray, nY: int,
                  levels: np.ndarray | None = None) -> tuple[UnitLowerSolver | LevelSolver, sp.csc_matrix]:
    """The lower-triangular system above (by levels when `levels` holds and the kernel is there),
    and T^T's F-source columns (n x nF)."""
    n, nF = cb.n, cb.n - nY
    matvec = csc_matvec_kernel() if levels is not None else None
    by_levels = matvec is not None
    counts = cb.counts.astype(np.intp)
    # Columns of the triangular matrix, one per state.  For SuperLU's kernel: its unit diagonal
    # first, then for a Y source its transitions, negated (I - T^T).  By levels: only the Y
    # sources' transitions (T^T's strictly lower part).  F columns: no transition; an F source's
    # transitions are A_F's column instead.  The transitions are read as the BFS stored
    # them (level by level, source by source) and written into their columns, both matrices in
    # one buffer.  Gathering them column by column (random sources) from the joined arrays, with
    # whole-matrix index arrays (~28 bytes per entry), was no faster warm and much slower on
    # fresh memory (the largest N = 7 chain of the 3-model case, 6.6M entries: 131-146 ms warm,
    # 509 ms on its first call, against 124-132 ms; 2-core Xeon, 2026-12-05).
    diag = 0 if by_levels else 1
    c = counts[order] + diag
    c[nY:] = diag
    ip = np.zeros(n + 1, dtype=np.intc)
    np.cumsum(c, out=ip[1:])
    ipF = np.zeros(nF + 1, dtype=np.intp)
    np.cumsum(counts[order[nY:]], out=ipF[1:])
    nL = int(ip[-1])
    # One buffer for both: the triangular matrix's entries, then A_F's.
    data = np.empty(nL + int(ipF[-1]))
    indices = np.empty(data.shape[0], dtype=np.intc)
    # Where a source's first transition goes: after its column's diagonal (Y), or its A_F column.
    first = np.where(pos < nY, ip[:-1][pos] + diag, nL + ipF[:-1][np.maximum(pos - nY, 0)])
    for a, b, dst, prob in zip(cb.level_starts[:-1], cb.level_starts[1:], cb.dst_parts, cb.prob_parts):
        cnt = counts[a:b]
        src = np.repeat(np.arange(b - a), cnt)  # each transition's source, from a
        at = (first[a:b] - (np.cumsum(cnt) - cnt))[src]  # minus the run's place in the level
        at += np.arange(src.shape[0], dtype=np.intp)
        data[at] = prob
        indices[at] = pos[dst]
    A_F = sp.csc_matrix((data[nL:], indices[nL:], ipF), shape=(n, nF))
    if by_levels:
        lower = LevelSolver(data[:nL], indices[:nL], ip, levels, matvec)
        if lower.levelled():
            return lower, A_F
        # A transition inside a level (not expected without contention): SuperLU's layout after all.
        return solver_blocks(cb, order, pos, nY, None)[0], A_F
    data[ip[:-1]] = -1.0
    indices[ip[:-1]] = pos[order]
    np.negative(data[:nL], out=data[:nL])  # I - T^T, with its unit diagonal
    return UnitLowerSolver(data[:nL], indices[:nL], ip), A_F


class LevelSolver:
    """x = (I - E)^-1 b for a sparse strictly lower-triangular E given by columns, whose columns
    fall into levels with no entry inside a level (Y's levels, `solver_order`).

    Column-oriented forward substitution, a level at a time: once the entries above level l are
    pushed, x's part in level l is final, and one sparse product pushes that part into the rows
    below (scipy's C `csc_matvec`, accumulating in place into x).  That reads E once, as a
    matrix-vector product does, with one call per level (~150 per solve in the 3-model search),
    where SuperLU's kernel (`UnitLowerSolver`) does fixed work per column on top: it cost ~2.3x a
    product of the same matrix.  It does the same additions in the same order, so the solutions are
    bit-identical.  Seconds in the solves, then the whole search, serial (2-core Xeon AVX-512,
    2026-12-06, two runs): the exhaustive 3-model search to N = 7, 3.04 / 3.04 s against 8.32 /
    8.28 s with SuperLU's kernel (2.7x; search 14.4 s against 20.1-20.5 s); the paper pair to
    N = 16, 0.39 / 0.36 s against 1.10 / 1.06 s (2.9x; 2.0-2.2 s against 2.8-2.9 s).  Without
    contention only: a contended chain's F takes the states a launch lengthens, and its Y has no
    such levels (SuperLU's kernel serves it).
    """

    def __init__(self, data: np.ndarray, indices: np.ndarray, indptr: np.ndarray, levels: np.ndarray,
                 matvec=None) -> None:
        self.n = indptr.size - 1
        self.data, self.indices, self.indptr = data, indices, indptr
        self.levels = levels
        self._matvec = matvec if matvec is not None else csc_matvec_kernel()  # (checked once by the caller)

    def levelled(self) -> bool:
        """True if no column's entry lies in its own level or above (what the solve relies on)."""
        lv = self.levels
        runs = self.indptr[lv]  # each level's first entry
        keep = runs[:-1] < runs[1:]  # levels with entries
        if not keep.any():
            return True
        lowest = np.minimum.reduceat(self.indices, runs[:-1][keep])
        return bool(np.all(lowest >= lv[1:][keep]))

    def solve(self, b: np.ndarray) -> np.ndarray:
        """Solves in place when b is a float64 array (the callers pass temporaries)."""
        x = np.asarray(b, dtype=float)
        n, ip, idx, data, mv, lv = self.n, self.indptr, self.indices, self.data, self._matvec, self.levels
        for s, e in zip(lv[:-1].tolist(), lv[1:].tolist()):
            mv(n, e - s, ip[s:e + 1], idx, data, x[s:e], x)
        return x


def csc_matvec_kernel():
    """scipy's C kernel y += A x for a CSC matrix (private API, like SuperLU's gstrs above), if it
    accumulates in place into a view on a small system, else None (then SuperLU's kernel serves)."""
    try:
        from scipy.sparse._sparsetools import csc_matvec

        ip = np.array([0, 1, 2, 2], dtype=np.intc)
        x = np.ones(3)
        csc_matvec(3, 1, ip[0:2], np.array([1, 2], dtype=np.intc), np.array([0.5, 0.25]), x[0:1], x)
        csc_matvec(3, 1, ip[1:3], np.array([1, 2], dtype=np.intc), np.array([0.5, 0.25]), x[1:2], x)
        return csc_matvec if np.allclose(x, [1.0, 1.5, 1.375], rtol=1e-15) else None
    except Exception:  # any API drift: SuperLU's kernel
        return None


# -------------------- per-chain GMRES and the power method --------------------
# Iterative solvers for the censored chain: per-chain GMRES and the power method.
#
# Many chains are solved at once (a block-diagonal system).  One Krylov space
# shared by all of them would have to resolve every chain's spectrum at once
# (55 chains needed 400 GMRES steps where each alone needs 10-15), so every
# chain keeps its own basis coefficients, Hessenberg matrix and stopping test;
# only the operator applications are shared.

PLAIN_SWEEPS = 300  # after this, chains still moving are treated as periodic
Operator = Callable[[np.ndarray], np.ndarray]


class Segments:
    """Chain c owns the contiguous slice starts[c]:starts[c + 1] of a vector."""

    def __init__(self, cid: np.ndarray, nB: int) -> None:
        bounds = np.searchsorted(cid, np.arange(nB + 1))
        if np.any(np.diff(cid) < 0) or np.any(np.diff(bounds) <= 0):
            raise SolverError("every chain needs a non-empty contiguous block of states")
        self.cid, self.nB, self.starts = cid, nB, bounds[:-1]

    def sums(self, v: np.ndarray) -> np.ndarray:  # (n,) -> (nB,)
        return np.add.reduceat(v, self.starts)

    # No BLAS (np.dot / @): a threaded OpenBLAS on a busy 2-core box spins for
    # milliseconds per call; einsum / reduceat stay in one thread.
    def dots(self, A: np.ndarray, w: np.ndarray) -> np.ndarray:  # (k, n), (n,) -> (k, nB)
        if self.nB == 1:
            return np.einsum("ij,j->i", A, w)[:, None]
        return np.add.reduceat(A * w, self.starts, axis=1)

    def combine(self, A: np.ndarray, h: np.ndarray) -> np.ndarray:  # sum_j A[j] * h[j, chain]
        if self.nB == 1:
            return np.einsum("ij,i->j", A, h[:, 0])
        return np.einsum("ij,ij->j", A, h[:, self.cid])

    def norms(self, v: np.ndarray) -> np.ndarray:
        return np.sqrt(self.sums(v * v))


def _inverse(v: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """1 / v where keep (and v != 0), else 0."""
    out = np.zeros_like(v)
    np.divide(1.0, v, out=out, where=keep & (v != 0))
    return out


def gmres(S: Operator, seg: Segments, u: np.ndarray, tol: float, restart: int = 60,
          max_iter: int = 1500) -> tuple[np.ndarray, np.ndarray, int]:
    """Solve (I - S) x + u * (chain sum of x) = u per chain; return (x, converged, steps).

    u is 1 at each chain's start state, so each chain's block of the unique
    solution is its stationary vector (the rank-one term pins the sum to 1
    and makes the system non-singular when the chain has one closed class).
    Periodic or slowly mixing chains are no problem here, unlike for the
    power method.  Converged chains drop out: their basis slices are zero.

    Why not `scipy.sparse.linalg.gmres`: it runs one Krylov space over the whole batch, which must
    resolve every chain's spectrum at once.  The router's start-up solves with it (same operator,
    same tolerance, restart 60), 2-core AMD EPYC AVX2, 2026-12-04, CPU seconds of the whole
    start-up solve, two runs: the paper pair (M = 2, N <= 16) 21.1 / 20.1 s against 6.1 / 5.0 s
    with this per-chain GMRES (3.5-4x), the 3-model case (N <= 8) 31.4 / 28.1 s against
    9.4 / 10.8 s (2.6-3.4x).
    """
    nB, n, cid = seg.nB, u.size, seg.cid

    def op(v: np.ndarray) -> np.ndarray:
        return v - S(v) + u * seg.sums(v)[cid]

    x = np.zeros(n)
    target = tol * seg.norms(u)
    failed = np.zeros(nB, dtype=bool)
    steps = 0
    while True:
        # x starts at 0, where op (linear: sparse products and one triangular solve) is exactly
        # 0: the first residual is u itself, without an operator application.
        r = u - op(x) if steps else u.copy()
        beta = seg.norms(r)
        active = (beta > target) & ~failed
        if not active.any() or steps >= max_iter:
            return x, ~active & ~failed, steps
        m = min(restart, max_iter - steps)
        V = np.empty((m + 1, n))
        H = np.zeros((nB, m + 1, m))
        cs, sn, g = np.zeros((nB, m)), np.zeros((nB, m)), np.zeros((nB, m + 1))
        g[:, 0] = np.where(active, beta, 0.0)
        V[0] = r * _inverse(beta, active)[cid]
        k_used = 0
        for k in range(m):
            w = op(V[k])
            steps += 1
            h = seg.dots(V[: k + 1], w)
            w -= seg.combine(V[: k + 1], h)
            h2 = seg.dots(V[: k + 1], w)  # re-orthogonalise once (CGS2)
            w -= seg.combine(V[: k + 1], h2)
            h += h2
            hn = seg.norms(w)
            H[:, : k + 1, k] = h.T
            for j in range(k):  # previous Givens rotations, every chain at once
                t = cs[:, j] * H[:, j, k] + sn[:, j] * H[:, j + 1, k]
                H[:, j + 1, k] = -sn[:, j] * H[:, j, k] + cs[:, j] * H[:, j + 1, k]
                H[:, j, k] = t
            den = np.hypot(H[:, k, k], hn)
            failed |= active & (den == 0)  # singular: no progress possible
            active &= den > 0
            inv = _inverse(den, den > 0)
            cs[:, k] = np.where(den > 0, H[:, k, k] * inv, 1.0)
            sn[:, k] = hn * inv
            H[:, k, k] = np.where(den > 0, den, 1.0)  # dropped chains: identity column
            g[:, k + 1] = -sn[:, k] * g[:, k]
            g[:, k] *= cs[:, k]
            k_used = k + 1
            active &= np.abs(g[:, k + 1]) > target
            if not active.any():
                break
            V[k + 1] = w * _inverse(hn, active)[cid]
        y = np.zeros((nB, k_used))
        for i in range(k_used - 1, -1, -1):  # back substitution, every chain at once
            y[:, i] = (g[:, i] - np.einsum("cj,cj->c", H[:, i, i + 1:k_used], y[:, i + 1:])) / H[:, i, i]
        x = x + seg.combine(V[:k_used], y.T)


def power(S: Operator, seg: Segments, x0: np.ndarray, tol: float, max_sweeps: int,
          which: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Power method from x0 (lazy after PLAIN_SWEEPS, for periodic chains).

    Only the chains in `which` (default: all) must converge; the others are
    carried along unchanged in value.

    Kept by hand: no scipy routine gives what it is used for, the long-run distribution a given
    start state leads to, per chain of a batch, when a chain may have several closed classes or be
    periodic (an eigensolver returns some vector of eigenvalue 1, not that mixture).  It is only
    a fallback: chains GMRES did not solve, chains with several closed classes, and the sync
    schedule's chain when its direct LU is singular.
    """
    cid = seg.cid
    x = x0 / seg.sums(x0)[cid]
    must = np.ones(seg.nB, dtype=bool) if which is None else which
    alpha = np.ones(seg.nB)
    for it in range(1, max_sweeps + 1):
        a = alpha[cid]
        xn = a * S(x) + (1.0 - a) * x
        xn /= seg.sums(xn)[cid]
        change = seg.sums(np.abs(xn - x))
        x = xn
        moving = (change >= tol) & must
        if not moving.any():
            return x, it
        if it == PLAIN_SWEEPS:
            alpha[moving] = 0.5
    raise SolverError(f"stationary solve did not converge in {max_sweeps} sweeps")


# -------------------- the stationary distribution --------------------
# Stationary distributions of a batch of chains, exploiting their time structure.
#
# Why not one sparse LU: for M = 3 a chain has 1e5-1e6 states and SuperLU's
# fill-in explodes (minutes at 9e4 states).  The chain has structure that a
# generic solver cannot see (`solver_order`): the feedback states F (the slowest
# running model has just launched) meet every cycle, so the rest Y is a DAG
# and (I - T_YY) is triangular in the right order.
#
# We solve the chain censored to F (|F| ~ 5-15 % of n), whose transition
# operator costs one triangular solve to apply:
#     S^T v = T_FF^T v + T_FY^T (I - T_YY^T)^-1 T_YF^T v.
# Restarted GMRES solves (I - S^T) x + u (1^T x) = u, u = the start state, in
# 10-70 applications per chain (each chain of a batch keeps its own Krylov
# coefficients, `gmres`); each chain's result is checked to be a fixed
# point (else a long-restart GMRES at a tighter tolerance, then a bounded
# power method, lazy if periodic, take over for that chain) and to be THE fixed point: a
# cheap sufficient condition on P, or else one reversed BFS, proves there is a
# single closed class.  With several, the power method on the full chain from
# the start state gives the long-run mixture the start leads to.  Exact up to
# the stopping tolerance.  Many chains are solved at once as one
# block-diagonal system (per-chain normalisation), which amortises overhead.

RETRY_TOL = 1e-4  # a chain GMRES failed is solved again to this share of the tolerance
# The power method as a last resort gets this many sweeps, then the chain fails (SolverError: the
# tuner keeps N - 1's thresholds for that N). A chain that reaches it is one that GMRES could not
# solve even at RETRY_TOL, where the power method crawls: each sweep applies the censored operator
# to the whole batch (up to ~300k states, ~5 ms), and 50000 of them held a router's start-up solve
# for over 20 minutes.
FALLBACK_SWEEPS = 5000


def stationary_batch(
    cb: ChainBatch, d_units: np.ndarray, *, tol: float = 1e-9, max_sweeps: int = 50000,
    P: np.ndarray | None = None,
) -> tuple[np.ndarray, int, np.ndarray]:
    """pi for every chain (each chain's block sums to 1), iterations, closed classes per chain."""
    n, nB = cb.n, cb.nB
    order, nY, levels = solver_order(cb, d_units)
    pos = np.empty(n, dtype=np.int32)
    pos[order] = np.arange(n, dtype=np.int32)
    lower, A_F = solver_blocks(cb, order, pos, nY, levels)

    last: list[np.ndarray] = []  # the latest (v, through_y(v))

    def through_y(v: np.ndarray) -> np.ndarray:  # [z_Y, S^T v] (see the F/Y blocks)
        # GMRES's last residual check applies the operator to the x it returns, and pi's Y part
        # is through_y of that same x: one triangular solve (a GMRES step's worth) saved.
        if last and np.array_equal(last[0], v):
            return last[1]
        z = lower.solve(A_F @ v)
        last[:] = [v.copy(), z]
        return z

    def censored(v: np.ndarray) -> np.ndarray:  # v -> S^T v, chain by chain
        return through_y(v)[nY:]

    seg = Segments(cb.cid[order[nY:]], nB)  # F comes chain by chain
    u = np.zeros(n - nY)
    u[pos[cb.start] - nY] = 1.0
    x, ok, iters = gmres(censored, seg, u, tol)
    z = through_y(x)  # checks x, and its Y part is the rest of pi
    ok &= fixed_points(x, z[nY:], seg, tol)
    if not ok.all():
        # A chain GMRES could not solve: once more alone with a long restart
        # (the others have u = 0 there, so they sit idle) and a tighter
        # tolerance, then the power method, which is slow on nearly periodic
        # chains but cannot go wrong.  The tolerance is what fixes nearly
        # decomposable chains: their x meets the residual test yet is off by
        # cond * tol (a cpu-tiny chain with contention, N = 13, B = (1, 2):
        # entries of -7e-6 at tol 1e-8, GMRES returning the same x with a long
        # restart, and the power method not converged after 50000 sweeps of
        # 29 s; at RETRY_TOL * tol it passes in 19 steps, 1.7e-6 in L1 from a
        # direct LU of the whole chain).
        bad = ~ok
        x2, ok2, more = gmres(censored, seg, u * bad[seg.cid], tol * RETRY_TOL, restart=150, max_iter=3000)
        iters += more
        ok2 &= bad & fixed_points(x2, censored(x2), seg, tol)
        x = np.where(ok2[seg.cid], x2, x)
        ok |= ok2
        z = None
    if not ok.all():
        start = np.where(ok[seg.cid], x, u)
        xp, more = power(censored, seg, start, tol, min(max_sweeps, FALLBACK_SWEEPS), which=~ok)
        iters += more
        x = np.where(ok[seg.cid], x, xp)
        z = None
    if not (P is not None and surely_one_class(P, cb.Bs)):
        # ... and unique.  With several closed classes the system is singular
        # and GMRES may return any mixture of their stationary vectors, not the
        # one the start state leads to.  One closed class <=> every state can
        # reach the chain's most likely state.
        if not _all_reach(cb, order[nY + _argmax_per_chain(x, seg.cid, nB)]):
            # The power method from the start state converges to the
            # long-run mixture it leads to.  It must run on the full chain:
            # censoring to F would reweight the classes by their |Y|/|F| mass.
            full, more = _power_full(cb, tol, max_sweeps)
            return full, iters + more, closed_classes(cb)
    classes = np.ones(nB, dtype=np.int64)
    full = np.concatenate([(through_y(x) if z is None else z)[:nY], x])
    np.clip(full, 0.0, None, out=full)
    cid_sorted = cb.cid[order]
    full /= np.bincount(cid_sorted, weights=full, minlength=nB)[cid_sorted]
    return full[pos], iters, classes


def fixed_points(x: np.ndarray, Sx: np.ndarray, seg: Segments, tol: float) -> np.ndarray:
    """Per chain: is x's block a distribution fixed by S (Sx = S x), up to the tolerance?"""
    resid = seg.sums(np.abs(Sx - x))
    lowest = np.minimum.reduceat(x, seg.starts)
    # Entries of states with ~0 mass come out at -tol-ish; they are clipped later.
    return (resid < 1e3 * tol) & (lowest > -1e2 * tol) & np.isfinite(resid)


def _power_full(cb: ChainBatch, tol: float, max_sweeps: int) -> tuple[np.ndarray, int]:
    """Cesaro limit of the embedded chain from each start state (slow, robust)."""
    n, nB = cb.n, cb.nB
    perm = np.argsort(cb.cid, kind="stable")  # chain by chain, for Segments
    at = np.empty(n, dtype=np.int64)
    at[perm] = np.arange(n)
    AT = sp.csr_matrix((cb.prob, (at[cb.dst], at[cb.src])), shape=(n, n))
    u = np.zeros(n)
    u[at[cb.start]] = 1.0
    x, it = power(lambda v: AT @ v, Segments(cb.cid[perm], nB), u, tol, max_sweeps)
    return x[at], it


def surely_one_class(P: np.ndarray, Bs: list[tuple[int, ...]]) -> bool:
    """A cheap sufficient condition for a single closed class (skips a BFS).

    If every model can send to model 0 (p_i0 > 0, i = 0 included) and model 0
    can feed every other model whose threshold can hold requests back
    (p_0j > 0 wherever B_j >= 2), then from any state the system can reach
    the start state (all N launched together on model 0): requests stuck
    below a threshold at an idle j are released by routing model 0's output
    there (feasibility leaves enough requests elsewhere for model 0 to run),
    every batch elsewhere can then return everything to model 0, and when
    model 0's batch completes with everyone staying, all N launch as one.
    A state reachable from every state means exactly one closed class.
    """
    if not np.all(P[:, 0] > 0):
        return False
    B = np.array(Bs).reshape(len(Bs), -1)
    needs_feed = (B[:, 1:] >= 2).any(axis=0)
    return bool(np.all(P[0, 1:][needs_feed] > 0))


def _argmax_per_chain(x: np.ndarray, cid: np.ndarray, nB: int) -> np.ndarray:
    """Index of the largest entry of x within each chain."""
    order = np.lexsort((-x, cid))  # by chain, then descending x
    first = np.searchsorted(cid[order], np.arange(nB))
    return order[first]


def _all_reach(cb: ChainBatch, targets: np.ndarray) -> bool:
    """True if every state of chain c can reach targets[c], for all c.

    One BFS over the reversed graph from a virtual node linked to all targets.
    """
    n, nB = cb.n, targets.size
    rows = np.concatenate([cb.dst, np.full(nB, n)])
    cols = np.concatenate([cb.src, targets])
    G = sp.csr_matrix((np.ones(rows.size, dtype=np.int8), (rows, cols)), shape=(n + 1, n + 1))
    seen = breadth_first_order(G, n, directed=True, return_predecessors=False)
    return seen.size == n + 1


def closed_classes(cb: ChainBatch) -> np.ndarray:
    """Number of closed communicating classes per chain (for reporting)."""
    n, nB = cb.n, len(cb.Bs)
    G = sp.csr_matrix((np.ones(cb.src.size, dtype=np.int8), (cb.src, cb.dst)), shape=(n, n))
    _, lab = connected_components(G, directed=True, connection="strong")
    leaves = np.ones(lab.max() + 1, dtype=bool)
    cross = lab[cb.src] != lab[cb.dst]
    leaves[lab[cb.src[cross]]] = False
    out = np.zeros(nB, dtype=np.int64)
    comp_chain = np.zeros(lab.max() + 1, dtype=np.int64)
    comp_chain[lab] = cb.cid
    np.add.at(out, comp_chain[leaves], 1)
    return out
