"""Iterative solvers for the censored chain: per-chain GMRES and the power method.

Many chains are solved at once (a block-diagonal system).  One Krylov space
shared by all of them would have to resolve every chain's spectrum at once
(55 chains needed 400 GMRES steps where each alone needs 10-15), so every
chain keeps its own basis coefficients, Hessenberg matrix and stopping test;
only the operator applications are shared.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ._blocks import SolverError

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
    """
    nB, n, cid = seg.nB, u.size, seg.cid

    def op(v: np.ndarray) -> np.ndarray:
        return v - S(v) + u * seg.sums(v)[cid]

    x = np.zeros(n)
    target = tol * seg.norms(u)
    failed = np.zeros(nB, dtype=bool)
    steps = 0
    while True:
        r = u - op(x)
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
