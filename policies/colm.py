"""`colm` (Co-LLM): the small model defers a token when its deferral head says so.

Co-LLM fine-tunes the small model (0) with one more output row, the deferral token (row V of its
output head, after the V tokens it shares with the large model): P(defer) = sigmoid of that row's
logit, the row's dot product with the final-normed hidden state. When P(defer) > eta (strictly, as
Co-LLM's generate.py compares) the small model's token is discarded, and the large model (1)
generates that position, commits it and hands straight back. Tokens are sampled from the first V
rows only, as Co-LLM's generate.py takes its argmax.

- `head=None`: serve the Co-LLM model as its authors save it, a directory whose vocabulary is one
  larger than the large model's (tied embeddings or not); the router reserves the extra row, and
  this policy reads its logit from each step.
- `head=`: a separately trained head on the hidden state (see `policies.checkpoints.load_linear_head`:
  a {"weight", "bias"} dict or file, as `aiorouter train-router --policy colm` writes, an (H,) tensor,
  or the last row of a (V+1)-row head in a file or model directory). A small model that has the
  extra row anyway is still served, its row unsampled.

`eta` defaults to 0.15, the TokenRouter paper's setting (our trainer prints the one it picked).
"""
from __future__ import annotations

from pathlib import Path

import torch

from policies.base import LARGE, SMALL, SmallLargePolicy
from policies.checkpoints import load_linear_head

PAPER_ETA = 0.15


class CoLLMPolicy(SmallLargePolicy):
    name = "colm"
    # a sigmoid of one column, or one dot product per row: cheaper than the hop to the worker thread
    route_in_worker = False
    per_request = False  # carries a trained network

    def __init__(self, head: str | Path | dict | torch.Tensor | None = None, eta: float = PAPER_ETA,
                 prior_p: float = 0.1):
        if not 0.0 <= eta <= 1.0:
            raise ValueError(f"colm: eta must be in [0, 1], got {eta!r}")
        self.head = load_linear_head(head) if head is not None else None
        self.needs_hidden = self.head is not None  # the model's own row arrives with the logits
        self.eta, self.prior_p = float(eta), float(prior_p)
        self.own_row = head is None  # until setup says whether the small model has one

    def setup(self, models):
        small, large = models[SMALL], models[LARGE]
        self.own_row = small.vocab_size == large.vocab_size + 1
        if self.head is None and not self.own_row:
            raise ValueError(f"colm: without head=, the deferral head is the small model's extra output row "
                             f"(Co-LLM's <|defer|>), so its vocabulary must be one larger than the large "
                             f"model's; {small.name!r} has {small.vocab_size} rows and {large.name!r} "
                             f"{large.vocab_size}: serve the Co-LLM model, or pass head=")

    def extra_rows(self, model):
        return 1 if model == SMALL and self.own_row else 0

    def p_defer(self, result) -> torch.Tensor:
        """P(defer) [B] for a step of the small model."""
        if self.head is None:
            if result.extra_logits is None:
                raise ValueError("colm without head= reads the small model's deferral row, and this step has none")
            return torch.sigmoid(result.extra_logits[:, 0].float())
        if result.hidden is None:
            raise ValueError("colm with a head needs the small model's hidden states")
        return self.head.prob(result.hidden, vocab=result.logits.shape[-1])

    def defer(self, result):  # P(defer) above eta: the large model writes this position
        return (self.p_defer(result) > self.eta).tolist()
