"""A routed request: the one object every model's subserver shares for it (same process,
so a handoff passes this object by reference; nothing is serialized)."""
from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from engines import SamplingParams, Sequence
from engines.detokenizer import IncrementalDetokenizer
from policies.base import PeerReq


class StreamEvent(NamedTuple):
    token_id: int | None  # None on a final event that carries no token
    text: str  # incremental, UTF-8-safe detokenized piece (may be empty)
    model: str | None  # the model that produced token_id
    index: int  # position of the token in the output
    finish_reason: str | None = None  # set on the last event of the stream


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    models: list[str]  # per output token
    finish_reason: str
    usage: dict  # prompt_tokens, completion_tokens, total_tokens, per_model


class ReqStatus(enum.Enum):
    ACTIVE = "active"
    FINISHED = "finished"


class RouterError(RuntimeError):
    """A request failed inside the router (a model's step raised, a policy misbehaved)."""


@dataclass(eq=False)
class RouterRequest:
    rid: str
    token_ids: list[int]  # committed: prompt + output
    num_prompt_tokens: int
    sampling: SamplingParams
    num_models: int
    detok: IncrementalDetokenizer | None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    status: ReqStatus = ReqStatus.ACTIVE
    finish_reason: str | None = None
    error: BaseException | None = None
    at: int = 0  # model currently responsible for the request
    seen: list[int] = field(default_factory=list)  # per model: tokens of token_ids it has seen
    local: list[Sequence | None] = field(default_factory=list)  # per model: its engine sequence
    trace: list[int] = field(default_factory=list)  # model index per output token
    state: dict = field(default_factory=dict)  # the policy's per-request scratch space
    emitted_chars: int = 0
    stop_cut: int | None = None
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    policy: object = None  # a per-request policy override, else None

    def __post_init__(self) -> None:
        self.seen = [0] * self.num_models
        self.local = [None] * self.num_models

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


# -- inbox messages (typed objects, dispatched by type; never strings) ---------------------------
class NewRequest(NamedTuple):
    req: RouterRequest


class Handoff(NamedTuple):
    req: RouterRequest
    peer_req: PeerReq
    src: int


class Release(NamedTuple):
    """The request is over (finished, aborted or failed): free or cache its KV here."""

    req: RouterRequest


class Wake(NamedTuple):
    """Something system-wide changed (a request ended): re-check the launch condition."""


class Kick(NamedTuple):
    """Every model is idle below its threshold and nothing is in flight: launch anyway. (The
    active count can fall below what the thresholds were solved for, e.g. as load drains.)"""
