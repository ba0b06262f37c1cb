"""`citer` (CITER): a confidence network on the small model's last hidden state.

After every step of the small model (0), the router scores its final-normed hidden state; when the
confidence sigmoid(router(h)) is below tau (paper setting 0.98) the small model's token is
discarded, and the large model (1) generates that position, commits it and hands straight back.

`router`: a `CITERRouter` checkpoint (from `aiorouter train-router --policy citer`) or instance.
`tau=None` takes the checkpoint's threshold, else 0.98.
"""
from __future__ import annotations

from pathlib import Path


from policies.base import SmallLargePolicy
from policies.networks import CITERRouter, load_router

PAPER_TAU = 0.98


class CITERPolicy(SmallLargePolicy):
    name = "citer"
    needs_hidden = True
    route_in_worker = True  # a network forward per step must not stall the other subservers
    per_request = False  # carries a trained network

    def __init__(self, router: str | Path | dict | CITERRouter, tau: float | None = None, prior_p: float = 0.1,
                 device: str = "cpu"):
        if isinstance(router, CITERRouter):
            self.net, saved = router.to(device).eval(), None
        else:
            self.net, meta = load_router(router, device=device)
            if not isinstance(self.net, CITERRouter):
                raise ValueError(f"citer: {router} holds a {meta['model_type']} router, not a CITER one")
            saved = meta["common_args"].get("threshold")
        self.tau = float(tau if tau is not None else saved if saved is not None else PAPER_TAU)
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"citer: tau must be in [0, 1], got {self.tau!r}")
        self.prior_p = float(prior_p)

    def defer(self, result):  # confidence below tau: the large model writes this position
        if result.hidden is None:
            raise ValueError("citer needs the small model's hidden states")
        return (self.net.prob(result.hidden) < self.tau).tolist()
