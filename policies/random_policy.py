"""`random`: R2R's handoff pattern with a coin instead of a router network.

The small model (0) hands a step to the large model (1) with probability p; its own token is
discarded, the large model generates that position, commits it and hands straight back.
Seeded per request, so a request's routing does not depend on what it is batched with.
"""
from __future__ import annotations

import zlib

import numpy as np

from policies.base import SmallLargePolicy


class RandomPolicy(SmallLargePolicy):
    name = "random"
    reads_logits = False  # a coin, not the model's distribution

    def __init__(self, p: float = 0.35, seed: int = 0):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"random policy: p must be in [0, 1], got {p!r}")
        self.p = self.prior_p = float(p)
        self.seed = int(seed)

    def _rng(self, req) -> np.random.Generator:
        rng = req.state.get("rng")
        if rng is None:
            rng = req.state["rng"] = np.random.default_rng([self.seed, zlib.crc32(req.rid.encode())])
        return rng

    def defer(self, result):
        return [self._rng(r).random() < self.p for r in result.reqs]
