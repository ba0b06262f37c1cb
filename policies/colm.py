"""`colm` (Co-LLM): the small model defers a token when its deferral head says so.

Co-LLM fine-tunes the small model (0) with one extra output: P(defer) = sigmoid(w . h + b) on its
final-normed hidden state h. When P(defer) > eta (paper setting 0.15) the small model's token is
discarded; the large model (1) generates that position, commits it and hands straight back.

Our engine's logits are [B, V], so the deferral head is read separately, as `head`:
- a `torch.save`d dict (or a dict) {"weight": [H] or [1, H], "bias": float};
- an (H,) tensor;
- the (V+1)-th row of a (V+1)-row lm_head: a (V+1, H) tensor, or `lm_head.weight` in a .pt or
  .safetensors file, or in a model directory's safetensors (its `lm_head.bias`, if any, gives b);
  V must then equal the served model's vocabulary, checked on the first step.
"""
from __future__ import annotations

from pathlib import Path

import torch

from policies.base import SmallLargePolicy
from policies.networks import load_linear_head


class CoLLMPolicy(SmallLargePolicy):
    name = "colm"
    needs_hidden = True
    route_in_worker = True  # a network forward per step must not stall the other subservers
    per_request = False  # carries a trained network

    def __init__(self, head: str | Path | dict | torch.Tensor, eta: float = 0.15, prior_p: float = 0.1):
        if not 0.0 <= eta <= 1.0:
            raise ValueError(f"colm: eta must be in [0, 1], got {eta!r}")
        self.head, self.eta, self.prior_p = load_linear_head(head), float(eta), float(prior_p)

    def defer(self, result):  # P(defer) above eta: the large model writes this position
        if result.hidden is None:
            raise ValueError("colm needs the small model's hidden states")
        return (self.head.prob(result.hidden, vocab=result.logits.shape[-1]) > self.eta).tolist()
