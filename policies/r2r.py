"""`r2r` (Roads to Rome): a router network flags the small model's divergent tokens.

After every step of the small model (0), R2R's router reads its last hidden state, the token it
sampled and its top-100 logits; when sigmoid(router) >= threshold the small model's token is
discarded and the large model (1) generates that position, commits it and hands straight back.

`router` is a checkpoint in R2R's official format (published routers work: their
`token_embeddings.weight` is rebuilt from `small_path`, the small model's directory) or an
`R2RRouter` instance. `threshold=None` takes the checkpoint's `common_args.threshold`.
"""
from __future__ import annotations

from pathlib import Path


from policies.base import SmallLargePolicy
from policies.networks import R2RRouter, load_embedding, load_router


class R2RPolicy(SmallLargePolicy):
    name = "r2r"
    needs_hidden = True
    route_in_worker = True  # a network forward per step must not stall the other subservers
    per_request = False  # carries a trained network

    def __init__(self, router: str | Path | dict | R2RRouter, small_path: str | Path | None = None,
                 threshold: float | None = None, prior_p: float = 0.1, device: str = "cpu"):
        if isinstance(router, R2RRouter):
            self.net, saved = router.to(device).eval(), None
        else:
            emb = load_embedding(small_path) if small_path is not None else None
            self.net, meta = load_router(router, embedding=emb, device=device)
            if not isinstance(self.net, R2RRouter):
                raise ValueError(f"r2r: {router} holds a {meta['model_type']} router, not an R2R one")
            saved = meta["common_args"].get("threshold")
        if threshold is None and saved is None:
            raise ValueError("r2r: the router carries no threshold (common_args.threshold); pass threshold=")
        self.threshold = float(threshold if threshold is not None else saved)
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"r2r: threshold must be in [0, 1], got {self.threshold!r}")
        self.prior_p = float(prior_p)

    def defer(self, result):  # the router flags a divergent token: the large model writes it
        if result.hidden is None:
            raise ValueError("r2r needs the small model's hidden states")
        return (self.net.prob(result.hidden, result.tokens, result.logits) >= self.threshold).tolist()
