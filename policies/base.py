"""The route/send/receive interface (TokenRouter, section 3.2): a routing algorithm seen from one request.

- `route(result)` runs after each decoding step of a model, once for its whole batch, and returns a
  destination per request: 0 keeps decoding locally, k >= 1 goes to the k-th peer of that model,
  its peers being the other models in router order (`peers(model)`).
- `send(req)` runs for a request that leaves. It returns a `PeerReq`: the request id, the suffix of
  tokens the peer has not yet seen, a finished status, algorithm-specific fields, and `loc`, the
  sender's decoding position before the send. Whether the token just sampled travels in the suffix
  (and so is committed) or is left for the peer to regenerate is the algorithm's choice.
- `receive(peer_req, req)` runs on the peer when the `PeerReq` arrives and returns the tokens it
  appends before resuming; by default every transferred token. It may attach state to `req.state`
  first, which the same model's `route` sees on that request's later steps.

Policies see plain data (`StepResult`, `ReqView`), never batching, threads or engine internals.

Around the three functions the runtime asks a policy three more things, each with a default that
changes nothing:
- `setup(models)` once at router start, with what each model is (`ModelInfo`: path, vocabulary,
  hidden size, device), so a router network can find its small model's files and device.
- `extra_rows(model)`: output rows past the shared vocabulary that a model's head carries for this
  policy (Co-LLM's deferral row). The runtime never samples them and passes them to `route` as
  `StepResult.extra_logits`; the router accepts a model that much larger than the others.
- `admit(rid, prompt_ids, text)` in `Router.submit`, before any model spends a step on the request:
  the model it starts on (None: the router's entry model). A query-level router that scores the
  text, or an ensemble that draws the first token's model too, decides here; per-token routing
  begins after that model's first step, as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Sequence

import numpy as np
import torch

STAY = 0


@dataclass
class PeerReq:
    rid: str
    tokens: list[int]  # the suffix the peer has not seen; tokens past the committed ones are committed by the send
    loc: int  # the sender's decoding position before the send (= committed tokens, prompt included)
    finished: bool = False  # the request is over: its new tokens are committed and it ends ("stop")
    extra: dict[str, Any] = field(default_factory=dict)  # algorithm-specific fields for the receiver


class ReqView(NamedTuple):
    """One request as a policy sees it on model `model`. Plain data: no scheduler internals."""

    rid: str
    model: int  # the model the request is on
    # committed tokens (prompt + output) as of this step; like model_trace, the request's own list,
    # not a copy (a copy per row per step was O(length): read them, never change them)
    token_ids: list[int]
    num_prompt_tokens: int
    sampled: int | None  # the token `model` just sampled (None in receive: nothing sampled yet)
    seen: tuple[int, ...]  # per model: how many of token_ids it has already seen
    model_trace: Sequence[int]  # which model committed each output token
    state: dict[str, Any]  # this policy's scratch space for the request on `model`
    peer: int | None = None  # in send: the model index the request goes to (the runtime resolves route's k)

    @property
    def loc(self) -> int:
        """The decoding position: the position of the token just sampled."""
        return len(self.token_ids)


class StepResult(NamedTuple):
    """One step's results for the batch of model `model`, row-aligned."""

    model: int
    logits: torch.Tensor  # [B, vocab] float32, the shared vocabulary only
    tokens: torch.Tensor  # [B] int64 sampled tokens
    hidden: torch.Tensor | None  # [B, hidden] final-normed hidden states (when needs_hidden)
    reqs: Sequence[ReqView]  # one per row, built as they are read (a list of them, to the policy)
    extra_logits: torch.Tensor | None = None  # [B, extra_rows(model)] the rows past the vocabulary, if any


class ModelInfo(NamedTuple):
    """What `Policy.setup` learns about one model at router start."""

    name: str
    path: str | None  # its HF directory (None: built in memory, or simulated)
    vocab_size: int  # rows of its output head (config.json's vocab_size)
    hidden_size: int
    device: str  # where its final hidden states are computed (the last device of a group)


class Policy:
    """Base class. Subclasses set `name`, implement `route`, and may override `send`/`receive`."""

    name: ClassVar[str] = "policy"
    num_models: ClassVar[int | None] = None  # exact number of models required, None for any >= 1
    needs_hidden: ClassVar[bool] = False
    # Does route/send/receive read StepResult.logits? In the runtime the logits are already in
    # memory; a dispatcher that gets each step's result over HTTP (bench's Std. Serving) fetches the
    # [vocab] row only when this is True (SmolLM2's row is 192 KiB of float32 per token).
    reads_logits: ClassVar[bool] = True
    commit_on_send: ClassVar[bool] = False  # default send: does the sampled token travel (and commit)?
    route_in_worker: ClassVar[bool] = False  # route is heavy (a router network): run it off the event loop
    per_request: ClassVar[bool] = True  # may a client pick this policy per request (no trained state)?

    @classmethod
    def allows_per_request(cls, args: dict[str, Any]) -> bool:
        """May a client build this policy with `args` for one request? Asked before it is built: a
        policy that reads files or imports code named by its arguments must say no to them, or a
        request could make the server load them (a checkpoint unpickled, a module imported)."""
        return cls.per_request

    def bind(self, model_names: Sequence[str]) -> None:
        """Called once when the router starts (and for a per-request policy, when it is submitted)."""
        if self.num_models is not None and len(model_names) != self.num_models:
            raise ValueError(f"policy {self.name!r} routes between {self.num_models} models, "
                             f"the router has {len(model_names)}: {list(model_names)}")
        self.model_names = list(model_names)

    def setup(self, models: Sequence[ModelInfo]) -> None:
        """Called once at router start, after `bind`, with each model's files, sizes and device,
        in router order. Raise ValueError for a model this policy cannot route (named in the message)."""

    def extra_rows(self, model: int) -> int:
        """Rows of `model`'s output head past the vocabulary the models share, read by this policy.
        Asked after `setup`; never sampled; handed to `route` as `StepResult.extra_logits`."""
        return 0

    @property
    def admits(self) -> bool:
        """Does this policy choose where a request starts (overrides `admit`)? The router builds
        the query text for `admit` only then: decoding a prompt's ids costs per request."""
        return type(self).admit is not Policy.admit

    def admit(self, rid: str, prompt_ids: list[int], text: str | None) -> int | None:
        """The model a new request starts on, decided before any model steps; None: the entry model.
        `text`: the prompt as text when there is one (a text prompt, the last chat message as
        RouteLLM reads it, or token ids decoded by the entry model's tokenizer), else None. Runs in
        `Router.submit`, on the event loop: keep it to a light scorer."""
        return None

    @property
    def M(self) -> int:
        return len(self.model_names)

    def peers(self, model: int) -> list[int]:
        """Model indices of `model`'s peers: destination k of `route` is peers(model)[k - 1]."""
        return [j for j in range(self.M) if j != model]

    # -- the three functions -----------------------------------------------------------------
    def route(self, result: StepResult) -> Sequence[int] | torch.Tensor | np.ndarray:
        raise NotImplementedError(f"policy {type(self).__name__} must implement route()")

    def send(self, req: ReqView) -> PeerReq:
        """The suffix the peer has not seen, with the sampled token when `commit_on_send`."""
        new = [req.sampled] if self.commit_on_send else []
        return PeerReq(req.rid, req.token_ids[req.seen[req.peer]:] + new, loc=req.loc)

    def receive(self, peer_req: PeerReq, req: ReqView) -> list[int]:
        """Tokens to append before resuming; by default all transferred tokens."""
        return peer_req.tokens

    # -- throughput-model template -----------------------------------------------------------
    def routing_template(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(P, C) for the DTMC tuner: P[i][j] routing probabilities after a step on model i,
        C[i][j] tokens committed on that move. None: no template (thresholds default to 1)."""
        return None


class SinglePolicy(Policy):
    """No routing: every request stays on the entry model."""

    name = "single"
    reads_logits = False

    def route(self, result):
        return [STAY] * len(result.reqs)

    def routing_template(self):
        M = self.M
        return np.eye(M), np.eye(M)


SMALL, LARGE = 0, 1


class SmallLargePolicy(Policy):
    """The small/large pattern of CITER, R2R, Co-LLM, R-Stitch and random routing: model 0 (small)
    writes; where `defer` flags its token, that token is discarded and model 1 (large) writes the
    position, commits it, and hands back where `hand_back` says (after one token by default).

    Subclasses write `defer` (and, like R-Stitch, may write `hand_back`); route and send are shared."""

    num_models = 2
    prior_p: float = 0.1  # P(defer) the throughput model assumes before it has observed any

    def defer(self, result: StepResult) -> Sequence[bool]:
        """Small model's step: per request, hand this position to the large model?"""
        raise NotImplementedError(f"policy {type(self).__name__} must implement defer()")

    def hand_back(self, result: StepResult) -> Sequence[bool]:
        """Large model's step: per request, give control back to the small model?"""
        return [True] * len(result.reqs)

    def route(self, result):
        move = self.defer(result) if result.model == SMALL else self.hand_back(result)
        return [1 if m else STAY for m in move]

    def send(self, req):
        keep = [req.sampled] if req.model == LARGE else []  # the large model's token is kept, the small's not
        return PeerReq(req.rid, req.token_ids[req.seen[req.peer]:] + keep, loc=req.loc)

    def routing_template(self):
        p = self.prior_p
        return np.array([[1 - p, p], [1.0, 0.0]]), np.array([[1.0, 0.0], [1.0, 0.0]])
