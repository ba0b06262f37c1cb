"""Memo of solved chains, keyed by the rounded inputs.

Key: (N, P rounded to P_DECIMALS, C, quanta table d[i, b], delta, contention
rounded to KAPPA_DECIMALS, B).  The solve itself uses the same rounded P and
contention (`rounded_spec`), so a key always determines its value.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .dtmc import DTMCResult
from .spec import ModelSpec

P_DECIMALS = 6  # P is rounded to this many decimals for the cache and the solve
KAPPA_DECIMALS = 4  # contention shares likewise (measured to a few %, so nothing is lost)


class SolveCache:
    """Thread-safe LRU of DTMCResult keyed by (N, rounded P, C, quanta, delta, B)."""

    def __init__(self, maxsize: int = 8192) -> None:
        self.maxsize = maxsize
        self._data: OrderedDict[tuple, DTMCResult] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def model_key(spec: ModelSpec, N: int) -> tuple:
        d = spec.quanta_table(N)
        return (
            N,
            tuple(tuple(round(p, P_DECIMALS) for p in row) for row in spec.P),
            tuple(tuple(round(c, 9) for c in row) for row in spec.C),
            tuple(tuple(int(x) for x in row[1:]) for row in d),
            spec.delta,
            None if spec.contention is None else spec.contention.rounded(KAPPA_DECIMALS).points,
        )

    def get(self, key: tuple) -> DTMCResult | None:
        with self._lock:
            r = self._data.get(key)
            if r is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return r

    def put(self, key: tuple, value: DTMCResult) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)


# One memo per process: results are pure functions of the key, so sharing it
# between routers is safe (it holds no per-request or per-model state).
DEFAULT_CACHE = SolveCache()


def rounded_spec(spec: ModelSpec) -> ModelSpec:
    """The spec actually solved: P rounded (then renormalised) and contention rounded like the
    cache key."""
    P = []
    for row in spec.P:
        r = [round(p, P_DECIMALS) for p in row]
        s = sum(r)
        P.append([x / s for x in r])
    con = None if spec.contention is None else spec.contention.rounded(KAPPA_DECIMALS)
    return ModelSpec.build(P, spec.C, spec.latency, spec.delta, con)
