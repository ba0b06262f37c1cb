"""Has the routing drifted from the P the thresholds were solved for?  (docs/throughput-model.md)

Pure functions on counts of routing decisions (i -> j), so the caller decides what window of
decisions to test (the Tuner uses those since its last solve).  An entry has drifted when it
moved by more than `margin` AND by more than `z` standard errors of a row with that many
decisions: a few hundred decisions cannot tell 0.35 from 0.40, and a margin alone would re-solve
on noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .spec import check_routing_matrix


@dataclass(frozen=True)
class RoutingDrift:
    """The outcome of one drift test."""

    drifted: bool
    observed_P: np.ndarray  # rows with enough decisions from the counts, the others from the reference
    entry: tuple[int, int] | None  # the entry that moved most (in standard errors), if any row was tested
    moved: float  # |observed - reference| at that entry
    z_score: float  # moved / its standard error
    decisions: int  # decisions in the tested rows


def observed_routing(counts: object, reference_P: object, min_row: int = 50) -> np.ndarray:
    """Row-normalised counts where a row has >= min_row decisions, else the reference row."""
    ref = check_routing_matrix(reference_P)
    c = np.asarray(counts, dtype=float)
    if c.shape != ref.shape:
        raise ValueError(f"routing counts have shape {c.shape}, expected {ref.shape}")
    if np.any(c < 0) or not np.all(np.isfinite(c)):
        raise ValueError("routing counts must be finite and non-negative")
    n = c.sum(axis=1)
    out = ref.copy()
    ok = n >= max(1, min_row)
    out[ok] = c[ok] / n[ok, None]
    return out


def routing_drift(reference_P: object, counts: object, *, margin: float = 0.05, z: float = 3.0,
                  min_row: int = 50) -> RoutingDrift:
    """Test the decision counts (M x M, i -> j) against the reference routing matrix."""
    if not margin >= 0 or not z >= 0:
        raise ValueError(f"margin and z must be >= 0, got {margin!r}, {z!r}")
    ref = check_routing_matrix(reference_P)
    obs = observed_routing(counts, ref, min_row)
    n = np.asarray(counts, dtype=float).sum(axis=1)
    tested = n >= max(1, min_row)
    best: tuple[float, tuple[int, int] | None, float] = (0.0, None, 0.0)
    drifted = False
    for i in np.flatnonzero(tested):
        for j in range(ref.shape[1]):
            moved = abs(obs[i, j] - ref[i, j])
            # Standard error under the reference (the null hypothesis); a reference of exactly
            # 0 or 1 gets the error of one decision in the row, so a single stray one is noise.
            se = max(math.sqrt(ref[i, j] * (1 - ref[i, j]) / n[i]), 1.0 / n[i])
            zs = moved / se
            if zs > best[0] or best[1] is None:
                best = (zs, (int(i), int(j)), moved)
            drifted |= moved > margin and zs > z
    return RoutingDrift(bool(drifted), obs, best[1], float(best[2]), float(best[0]), int(n[tested].sum()))
