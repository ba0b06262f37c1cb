"""`ensemble` (ME): after every token the next model is drawn from the ensemble weights.

Any number of models (>= 2). The model that writes the first token is drawn with the same weights
at admission, before any model steps; after each step of model i, model j is drawn with
probability weights[j] (seeded per request). The token model i just sampled is always committed: on a draw of
i it stays; otherwise the request moves to j carrying that token, and j first extends over every
token it has not seen yet (lazy catch-up), then samples the next one.
"""
from __future__ import annotations

import math
import zlib
from typing import Annotated

import numpy as np
from pydantic import Field

from policies.base import Policy


class EnsemblePolicy(Policy):
    name = "ensemble"
    commit_on_send = True  # the default send carries the sampled token: it is committed on a move

    def __init__(self, weights: list[float] | tuple[float, ...] = (0.5, 0.3, 0.2),
                 seed: Annotated[int, Field(ge=0)] = 0):  # the argument schema (policies.argument_schema)
        w = [float(x) for x in weights]
        if len(w) < 2:
            raise ValueError(f"ensemble: needs weights for at least 2 models, got {w}")
        if any(not math.isfinite(x) or x < 0 for x in w):
            raise ValueError(f"ensemble: weights must be finite and >= 0, got {w}")
        if abs(sum(w) - 1.0) > 1e-6:
            raise ValueError(f"ensemble: weights must sum to 1, got {w} (sum {sum(w):g})")
        self.weights, self.seed = np.array(w) / sum(w), int(seed)

    def bind(self, model_names):
        if len(self.weights) != len(model_names):
            raise ValueError(f"policy 'ensemble' has {len(self.weights)} weights, one per model, but the router "
                             f"has {len(model_names)} models: {list(model_names)}")
        super().bind(model_names)
        # per model, the weights in destination order (stay, then its peers): route draws k directly
        self.dest_weights = [self.weights[[i] + self.peers(i)] for i in range(self.M)]

    def _rng(self, req) -> np.random.Generator:
        rng = req.state.get("rng")
        if rng is None:  # one stream per (request, model): draws do not depend on batching
            rng = req.state["rng"] = np.random.default_rng([self.seed, zlib.crc32(req.rid.encode()), req.model])
        return rng

    def admit(self, rid, prompt_ids, text):  # the first token's model is drawn too
        rng = np.random.default_rng([self.seed, zlib.crc32(rid.encode()), self.M])  # apart from the per-model streams
        return int(rng.choice(self.M, p=self.weights))

    def route(self, result):
        w = self.dest_weights[result.model]
        return [int(self._rng(r).choice(len(w), p=w)) for r in result.reqs]

    def routing_template(self):
        M = len(self.weights)
        return np.tile(self.weights, (M, 1)), np.ones((M, M))
