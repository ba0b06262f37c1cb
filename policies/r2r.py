"""`r2r` (Roads to Rome): a router network flags the small model's divergent tokens.

After every step of the small model (0), R2R's router reads its last hidden state, the token it
sampled and its top-100 logits; when sigmoid(router) >= threshold the small model's token is
discarded and the large model (1) generates that position, commits it and hands straight back.

`router` is a checkpoint in R2R's official format (or an `R2RRouter`). Published routers leave out
their copy of the small model's input embedding; it is read from the small model's directory:
`small_path` if given, else the directory `model_dirs` maps the checkpoint's
`init_args.pretrained_model_name` to, else the served small model's own directory when its path
names that model (`/models/Qwen3-0.6B`, `.../Qwen/Qwen3-0.6B`, or an HF cache snapshot of it).
`threshold=None` takes the checkpoint's `common_args.threshold`. The network runs on the small
model's device unless `device` says otherwise. A checkpoint that needs a full unpickle is opened
only with `trust_checkpoint=True`.
"""
from __future__ import annotations

from pathlib import Path

from policies.base import SMALL, SmallLargePolicy
from policies.checkpoints import build_router, load_embedding, read_router
from policies.networks import R2RRouter


def names_model(name: str, path: str) -> bool:
    """Is the local model directory `path` the model R2R's `pretrained_model_name` names (a hub id
    or a path, as `from_pretrained` takes it)?"""
    p = Path(path).resolve()
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser().resolve() == p
    parts = [x for x in name.split("/") if x]
    if not parts:
        return False
    low = [x.lower() for x in p.parts]
    return ([x.lower() for x in parts] == low[-len(parts):] or parts[-1].lower() == p.name.lower()
            or "models--" + "--".join(parts).lower() in low)  # an HF cache snapshot


class R2RPolicy(SmallLargePolicy):
    name = "r2r"
    needs_hidden = True
    route_in_worker = True  # a network forward per step must not stall the other subservers
    per_request = False  # carries a trained network

    def __init__(self, router: str | Path | dict | R2RRouter, small_path: str | Path | None = None,
                 threshold: float | None = None, prior_p: float = 0.1, device: str | None = None,
                 model_dirs: dict[str, str] | None = None, trust_checkpoint: bool = False):
        self.device, self.pending, saved = device, None, None
        self.source = str(router) if isinstance(router, (str, Path)) else type(router).__name__
        if isinstance(router, R2RRouter):
            self.net = router.eval()
        else:
            ckpt = read_router(router, trust_checkpoint)
            saved = ckpt["common_args"].get("threshold")
            self.small_name = str(ckpt["init_args"]["pretrained_model_name"])
            src = small_path if small_path is not None else (model_dirs or {}).get(self.small_name)
            if src is not None or "token_embeddings.weight" in ckpt["state_dict"]:
                self.net = build_router(ckpt, load_embedding(src) if src is not None else None)
            else:  # built at setup, from the served small model's directory
                self.net, self.pending = None, ckpt
        if threshold is None and saved is None:
            raise ValueError("r2r: the router carries no threshold (common_args.threshold); pass threshold=")
        self.threshold = float(threshold if threshold is not None else saved)
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"r2r: threshold must be in [0, 1], got {self.threshold!r}")
        if self.net is not None and device is not None:
            self.net.to(device)
        self.prior_p = float(prior_p)

    def setup(self, models):
        small = models[SMALL]
        if self.net is None:
            if small.path is None or not names_model(self.small_name, small.path):
                raise ValueError(f"r2r: the router {self.source} reads the input embedding of {self.small_name!r} "
                                 f"(its init_args.pretrained_model_name), and the small model {small.name!r} "
                                 f"({small.path or 'built in memory'}) is not named so: pass small_path=DIR or "
                                 f"model_dirs={{{self.small_name!r}: DIR}}")
            self.net, self.pending = build_router(self.pending, load_embedding(small.path)), None
        rows = self.net.token_embeddings.num_embeddings
        if (rows, self.net.hidden_size) != (small.vocab_size, small.hidden_size):
            raise ValueError(f"r2r: the router {self.source} is for a small model with vocabulary {rows} and hidden "
                             f"size {self.net.hidden_size}; {small.name!r} has {small.vocab_size} and "
                             f"{small.hidden_size}")
        if self.device is None:
            self.net.to(small.device)

    def defer(self, result):  # the router flags a divergent token: the large model writes it
        if result.hidden is None:
            raise ValueError("r2r needs the small model's hidden states")
        return (self.net.prob(result.hidden, result.tokens, result.logits) >= self.threshold).tolist()
