"""`citer` (CITER): a confidence network on the small model's last hidden state.

After every step of the small model (0), the router scores its final-normed hidden state (what
CITER's token_route.py reads: the last entry of `hidden_states`); when the confidence
sigmoid(router(h)) is below tau the small model's token is discarded, and the large model (1)
generates that position, commits it and hands straight back.

`router`: CITER's own checkpoint, an `mlp_iter_*.pth` state dict as its mlp_training.py saves it
(also what `aiorouter train-router --policy citer` writes), the loaded dict, or a `CITERRouter`.
Its hidden size must be the small model's (config.json's hidden_size), checked at router start.
`tau` defaults to the TokenRouter paper's 0.98 (our trainer prints the threshold it picked, and
records it in `<file>.json`). `device` defaults to the small model's.
"""
from __future__ import annotations

from pathlib import Path

from policies.base import SMALL, SmallLargePolicy
from policies.checkpoints import load_citer
from policies.networks import CITERRouter

PAPER_TAU = 0.98


class CITERPolicy(SmallLargePolicy):
    name = "citer"
    needs_hidden = True
    route_in_worker = True  # a network forward per step must not stall the other subservers
    per_request = False  # carries a trained network

    def __init__(self, router: str | Path | dict | CITERRouter, tau: float = PAPER_TAU, prior_p: float = 0.1,
                 device: str | None = None, trust_checkpoint: bool = False):
        self.source = str(router) if isinstance(router, (str, Path)) else type(router).__name__
        self.net = router if isinstance(router, CITERRouter) else load_citer(router, trust_checkpoint)[0]
        self.net.eval()
        self.device = device
        if device is not None:
            self.net.to(device)
        self.tau = float(tau)
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"citer: tau must be in [0, 1], got {self.tau!r}")
        self.prior_p = float(prior_p)

    def setup(self, models):
        small = models[SMALL]
        if small.hidden_size != self.net.hidden_size:
            raise ValueError(f"citer: the router {self.source} has weights for hidden size {self.net.hidden_size}; "
                             f"the small model {small.name!r} has hidden_size {small.hidden_size}")
        if self.device is None:
            self.net.to(small.device)

    def defer(self, result):  # confidence below tau: the large model writes this position
        if result.hidden is None:
            raise ValueError("citer needs the small model's hidden states")
        return (self.net.prob(result.hidden) < self.tau).tolist()
