"""`random`: R2R's handoff pattern with a coin instead of a router network.

The small model (0) hands a step to the large model (1) with probability p; its own token is
discarded, the large model generates that position, commits it and hands straight back.
Seeded per request, so a request's routing does not depend on what it is batched with:
`key="request"` (the default) draws each request's coins from its request id, a fresh uuid, so
no two requests route alike, even two with one prompt; `key="prompt"` draws them from the prompt,
so a prompt routes the same way in every request and every run, as a router network's decisions
would. A benchmark that compares schedules on the same prompts (bench.modes) gets the
same work in each then, not a new draw of the coins.
"""
from __future__ import annotations

import zlib
from typing import Annotated, Literal

import numpy as np
from pydantic import Field

from policies.base import SmallLargePolicy


class RandomPolicy(SmallLargePolicy):
    name = "random"
    reads_logits = False  # a coin, not the model's distribution

    def __init__(self, p: float = 0.35, seed: Annotated[int, Field(ge=0)] = 0,
                 key: Literal["request", "prompt"] = "request"):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"random policy: p must be in [0, 1], got {p!r}")
        if key not in ("request", "prompt"):
            raise ValueError(f"random policy: key must be 'request' or 'prompt', got {key!r}")
        self.p = self.prior_p = float(p)
        self.seed = int(seed)
        self.key = key

    def _rng(self, req) -> np.random.Generator:
        rng = req.state.get("rng")
        if rng is None:
            who = (req.rid.encode() if self.key == "request" else
                   np.asarray(req.token_ids[:req.num_prompt_tokens], dtype=np.int64).tobytes())
            rng = req.state["rng"] = np.random.default_rng([self.seed, zlib.crc32(who)])
        return rng

    def defer(self, result):
        return [self._rng(r).random() < self.p for r in result.reqs]
