"""Stationary distributions of a batch of chains, exploiting their time structure.

Why not one sparse LU: for M = 3 a chain has 1e5-1e6 states and SuperLU's
fill-in explodes (minutes at 9e4 states).  The chain has structure that a
generic solver cannot see (`_blocks`): the feedback states F (the slowest
running model has just launched) meet every cycle, so the rest Y is a DAG
and (I - T_YY) is triangular in the right order.

We solve the chain censored to F (|F| ~ 5-15 % of n), whose transition
operator costs one triangular solve to apply:
    S^T v = T_FF^T v + T_FY^T (I - T_YY^T)^-1 T_YF^T v.
Restarted GMRES solves (I - S^T) x + u (1^T x) = u, u = the start state, in
10-70 applications per chain (each chain of a batch keeps its own Krylov
coefficients, `_iterate`); each chain's result is checked to be a fixed
point (else a long-restart GMRES at a tighter tolerance, then a bounded
power method, lazy if periodic, take over for that chain) and to be THE fixed point: a
cheap sufficient condition on P, or else one reversed BFS, proves there is a
single closed class.  With several, the power method on the full chain from
the start state gives the long-run mixture the start leads to.  Exact up to
the stopping tolerance.  Many chains are solved at once as one
block-diagonal system (per-chain normalisation), which amortises overhead.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import breadth_first_order, connected_components

from ._blocks import SolverError, solver_blocks, solver_order
from ._iterate import Segments, gmres, power
from ._statespace import ChainBatch

__all__ = ["SolverError", "solver_order", "stationary_batch"]

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
    order, nY = solver_order(cb, d_units)
    pos = np.empty(n, dtype=np.int32)
    pos[order] = np.arange(n, dtype=np.int32)
    lower, A_F = solver_blocks(cb, order, pos, nY)

    def through_y(v: np.ndarray) -> np.ndarray:  # [z_Y, S^T v] (see _blocks)
        return lower.solve(A_F @ v)

    def censored(v: np.ndarray) -> np.ndarray:  # v -> S^T v, chain by chain
        return through_y(v)[nY:]

    seg = Segments(cb.cid[order[nY:]], nB)  # F comes chain by chain
    u = np.zeros(n - nY)
    u[pos[cb.start] - nY] = 1.0
    x, ok, iters = gmres(censored, seg, u, tol)
    z = through_y(x)  # checks x, and its Y part is the rest of pi
    ok &= _fixed_points(x, z[nY:], seg, tol)
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
        ok2 &= bad & _fixed_points(x2, censored(x2), seg, tol)
        x = np.where(ok2[seg.cid], x2, x)
        ok |= ok2
        z = None
    if not ok.all():
        start = np.where(ok[seg.cid], x, u)
        xp, more = power(censored, seg, start, tol, min(max_sweeps, FALLBACK_SWEEPS), which=~ok)
        iters += more
        x = np.where(ok[seg.cid], x, xp)
        z = None
    if not (P is not None and _surely_one_class(P, cb.Bs)):
        # ... and unique.  With several closed classes the system is singular
        # and GMRES may return any mixture of their stationary vectors, not the
        # one the start state leads to.  One closed class <=> every state can
        # reach the chain's most likely state.
        if not _all_reach(cb, order[nY + _argmax_per_chain(x, seg.cid, nB)]):
            # The power method from the start state converges to the
            # long-run mixture it leads to.  It must run on the full chain:
            # censoring to F would reweight the classes by their |Y|/|F| mass.
            full, more = _power_full(cb, tol, max_sweeps)
            return full, iters + more, _closed_classes(cb)
    classes = np.ones(nB, dtype=np.int64)
    full = np.concatenate([(through_y(x) if z is None else z)[:nY], x])
    np.clip(full, 0.0, None, out=full)
    cid_sorted = cb.cid[order]
    full /= np.bincount(cid_sorted, weights=full, minlength=nB)[cid_sorted]
    return full[pos], iters, classes


def _fixed_points(x: np.ndarray, Sx: np.ndarray, seg: Segments, tol: float) -> np.ndarray:
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


def _surely_one_class(P: np.ndarray, Bs: list[tuple[int, ...]]) -> bool:
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


def _closed_classes(cb: ChainBatch) -> np.ndarray:
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
