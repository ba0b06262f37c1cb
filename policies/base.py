"""The route/send/receive interface: a routing algorithm seen from one request.

After every decoding step of model `model`, the runtime calls `route` once for the whole
batch. Destination 0 means stay; k >= 1 means the k-th *peer* of `model`, peers being the
other models in router order (`peers(model)`); `to_peer(model, target)` converts a model
index into that code. A request that leaves gets a `PeerReq` from `send`; the receiving
model turns it into the tokens it appends with `receive`.

Token semantics: on stay, the sampled token is committed. On a move, `send` decides: put
the sampled token into `PeerReq.tokens` to commit it (ensemble), or leave it out to have
the peer regenerate that position (R2R, R-Stitch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

STAY = 0


@dataclass
class PeerReq:
    rid: str
    tokens: list[int]  # the suffix the receiver has not seen (newly committed tokens at its end)
    loc: int  # position of tokens[0] in the full sequence = tokens the receiver had already seen
    finished: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # algorithm-specific fields


class ReqView(NamedTuple):
    """What a policy may read about one request. Plain data: no scheduler internals."""

    rid: str
    token_ids: list[int]  # committed tokens (prompt + output) as of this step
    num_prompt_tokens: int
    sampled: int  # the token this model just sampled (committed only if the request stays or send includes it)
    seen: tuple[int, ...]  # per model: how many of token_ids it has already seen
    model_trace: tuple[int, ...]  # which model committed each output token
    state: dict[str, Any]  # per-request scratch space the policy owns


class RouteInput(NamedTuple):
    """One step's results for the batch of model `model`, row-aligned."""

    logits: torch.Tensor  # [B, vocab] float32
    tokens: torch.Tensor  # [B] int64 sampled tokens
    hidden: torch.Tensor | None  # [B, hidden] final-normed hidden states (when needs_hidden)
    reqs: list[ReqView]


class Policy:
    """Base class. Subclasses set `name`, implement `route`, and may override `send`/`receive`."""

    name: ClassVar[str] = "policy"
    num_models: ClassVar[int | None] = None  # exact number of models required, None for any >= 1
    needs_hidden: ClassVar[bool] = False
    commit_on_send: ClassVar[bool] = False  # default send: commit the sampled token when leaving?
    route_in_worker: ClassVar[bool] = False  # route is heavy (a router network): run it off the event loop
    per_request: ClassVar[bool] = True  # may a client pick this policy per request (no trained state)?

    def bind(self, model_names: list[str]) -> None:
        """Called once when the router starts."""
        if self.num_models is not None and len(model_names) != self.num_models:
            raise ValueError(f"policy {self.name!r} routes between {self.num_models} models, "
                             f"the router has {len(model_names)}: {model_names}")
        self.model_names = list(model_names)

    @property
    def M(self) -> int:
        return len(self.model_names)

    # -- peer indexing -----------------------------------------------------------------------
    def peers(self, model: int) -> list[int]:
        return [j for j in range(self.M) if j != model]

    def to_peer(self, model: int, target: int) -> int:
        """Destination code for sending from `model` to model index `target` (0 if same)."""
        return 0 if target == model else self.peers(model).index(target) + 1

    def resolve(self, model: int, dest: int) -> int:
        """Model index for destination code `dest` (inverse of to_peer)."""
        if dest == STAY:
            return model
        peers = self.peers(model)
        if not 1 <= dest <= len(peers):
            raise ValueError(f"policy {self.name!r} routed to peer {dest} from model {model}, "
                             f"but there are only {len(peers)} peers")
        return peers[dest - 1]

    # -- the three functions -----------------------------------------------------------------
    def route(self, model: int, result: RouteInput) -> list[int] | torch.Tensor | np.ndarray:
        raise NotImplementedError(f"policy {type(self).__name__} must implement route()")

    def send(self, model: int, req: ReqView, target: int) -> PeerReq:
        seen = req.seen[target]
        tokens = req.token_ids[seen:] + ([req.sampled] if self.commit_on_send else [])
        return PeerReq(req.rid, tokens, loc=seen)

    def receive(self, model: int, peer_req: PeerReq) -> list[int]:
        """Tokens to append locally; by default all transferred tokens."""
        return peer_req.tokens

    # -- throughput-model template -----------------------------------------------------------
    def routing_template(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(P, C) for the DTMC tuner: P[i][j] routing probabilities after a step on model i,
        C[i][j] tokens committed on that move. None: no template (thresholds default to 1)."""
        return None


class SinglePolicy(Policy):
    """No routing: every request stays on the entry model."""

    name = "single"

    def route(self, model, result):
        return [STAY] * len(result.reqs)

    def routing_template(self):
        M = self.M
        return np.eye(M), np.eye(M)
