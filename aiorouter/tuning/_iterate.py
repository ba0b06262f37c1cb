"""Iterative solvers for the censored chain: restarted GMRES and the power method."""

from __future__ import annotations

from typing import Callable

import numpy as np
from scipy.linalg import solve_triangular

from ._blocks import SolverError

PLAIN_SWEEPS = 300  # after this, chains still moving are treated as periodic


def _norm(v: np.ndarray) -> float:
    # Not np.linalg.norm: that is a BLAS ddot, which a threaded OpenBLAS on a
    # busy machine turns into milliseconds of spinning per call.
    return float(np.sqrt(np.einsum("i,i->", v, v)))


def gmres(
    S: Callable[[np.ndarray], np.ndarray],
    sums: Callable[[np.ndarray], np.ndarray],
    cidF: np.ndarray,
    u: np.ndarray,
    tol: float,
    restart: int = 40,
    max_iter: int = 1500,
) -> tuple[np.ndarray | None, int]:
    """Solve (I - S^T) x + u * (chain sum of x) = u with restarted GMRES.

    u is 1 at each chain's start state, so every chain's block of the unique
    solution is its stationary vector (the rank-one term pins the sum to 1
    and makes the system non-singular when the chain has one closed class).
    Periodic chains are no problem here, unlike for the power method.
    Inner products use einsum, not BLAS: a threaded BLAS on a busy 2-core
    box was several times slower for these skinny products.
    """
    n = u.size

    def op(v: np.ndarray) -> np.ndarray:
        return v - S(v) + u * sums(v)[cidF]

    x = np.zeros(n)
    done_iters = 0
    target = tol * _norm(u)
    while done_iters < max_iter:
        r = u - op(x)
        beta = _norm(r)
        if beta <= target:
            return x, done_iters
        m = min(restart, max_iter - done_iters)
        V = np.empty((m + 1, n))
        H = np.zeros((m + 1, m))
        cs, sn, g = np.zeros(m), np.zeros(m), np.zeros(m + 1)
        g[0] = beta
        V[0] = r / beta
        k_used = m
        for k in range(m):
            w = op(V[k])
            done_iters += 1
            h = np.einsum("ij,j->i", V[: k + 1], w)
            w -= np.einsum("ij,i->j", V[: k + 1], h)
            h2 = np.einsum("ij,j->i", V[: k + 1], w)  # re-orthogonalise once
            w -= np.einsum("ij,i->j", V[: k + 1], h2)
            h += h2
            hn = _norm(w)
            H[: k + 1, k] = h
            for j in range(k):  # apply previous Givens rotations
                t = cs[j] * H[j, k] + sn[j] * H[j + 1, k]
                H[j + 1, k] = -sn[j] * H[j, k] + cs[j] * H[j + 1, k]
                H[j, k] = t
            den = float(np.hypot(H[k, k], hn))
            if den == 0.0:
                return None, done_iters
            cs[k], sn[k] = H[k, k] / den, hn / den
            H[k, k] = den
            g[k + 1] = -sn[k] * g[k]
            g[k] = cs[k] * g[k]
            if abs(g[k + 1]) <= target or hn == 0.0:
                k_used = k + 1
                break
            V[k + 1] = w / hn
        y = solve_triangular(H[:k_used, :k_used], g[:k_used])
        x = x + np.einsum("ij,i->j", V[:k_used], y)
        if abs(g[k_used]) <= target:
            return x, done_iters
    return None, done_iters


def power(
    S: Callable[[np.ndarray], np.ndarray],
    sums: Callable[[np.ndarray], np.ndarray],
    cidF: np.ndarray,
    u: np.ndarray,
    nB: int,
    tol: float,
    max_sweeps: int,
) -> tuple[np.ndarray, int]:
    """Power method from the start states; lazy after PLAIN_SWEEPS (periodicity)."""
    x = u.copy()
    alpha = np.ones(nB)
    for it in range(1, max_sweeps + 1):
        a = alpha[cidF]
        xn = a * S(x) + (1.0 - a) * x
        xn /= sums(xn)[cidF]
        change = sums(np.abs(xn - x))
        x = xn
        active = change >= tol
        if not active.any():
            return x, it
        if it == PLAIN_SWEEPS:
            alpha[active] = 0.5
    raise SolverError(f"stationary solve did not converge in {max_sweeps} sweeps")
