"""A routed request: the one object every model's subserver shares for it (same process, so a
handoff passes this object by reference; nothing is serialized), and the inbox messages."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engines import SamplingParams, Sequence
from engines.logprobs import TokenLogprob
from engines.output import OutputStream
from policies.base import PeerReq, Policy


class StreamEvent(NamedTuple):
    token_id: int | None  # None on a final event that carries no token
    # incremental, UTF-8-safe detokenized piece (may be empty); None inside the router until its
    # consumer takes it (RouterRequest.with_text): a client's events carry their text
    text: str | None
    model: str | None  # the model that produced token_id
    index: int  # position of the token in the output
    finish_reason: str | None = None  # set on the last event of the stream
    # token_id's log probability under `model`, and the alternatives asked for, when the request
    # asked (submit's logprobs / top_logprobs)
    logprob: TokenLogprob | None = None


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    models: list[str]  # per output token
    finish_reason: str
    usage: dict  # prompt_tokens, completion_tokens, total_tokens, per_model
    logprobs: list[TokenLogprob] | None = None  # per output token, from the model that wrote it, when asked


class EventStream:
    """One request's events, in order, each once: the router pushes them (never blocking), one
    consumer takes them. The consumer wakes once for whatever has arrived since it last took, and a
    consumer that wants only the whole answer (`Router.generate`) wakes once, at the end. An
    `asyncio.Queue` woke its getter per token: at N = 64 on zero-latency sims the wakeups and the
    getter's task steps were ~15 % of the event loop's time (`python -m bench.host_cost --profile`)."""

    def __init__(self) -> None:
        self._items: list[StreamEvent | BaseException] = []
        self._waiter: asyncio.Future | None = None
        self._whole = False  # the waiter wants the final event, not the next one
        self.ended = False  # the final event (a finish reason, or an error) was pushed

    def push(self, ev: StreamEvent | BaseException) -> None:
        self._items.append(ev)
        final = isinstance(ev, BaseException) or ev.finish_reason is not None
        self.ended = self.ended or final
        w = self._waiter
        if w is not None and not w.done() and (final or not self._whole):
            w.set_result(None)

    async def take(self, whole: bool = False) -> list[StreamEvent | BaseException]:
        """Every event pushed and not yet taken, once there is one (`whole`: once the final one is)."""
        while not (self.ended if whole else self._items):
            self._whole, self._waiter = whole, asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class RouterError(RuntimeError):
    """A request failed inside the router (a model's step raised, a policy misbehaved)."""


class RouterRequestError(RouterError):
    """A request failed through what it asked for, not through the router: its structured output
    allows no token of the vocabulary partway through (it cannot be completed). The server answers
    400, as for a request refused on arrival."""


class RouterUnavailable(RouterError):
    """The router takes no request now: a model's subserver died and is restarting (retry shortly),
    or it died more often than the router restarts it (`Router.dead`: a new router is needed)."""


@dataclass(eq=False)
class RouterRequest:
    rid: str
    out: OutputStream  # committed tokens (prompt + output), stop checks, streamed text
    policy: Policy  # the router's, or this request's override
    num_models: int
    events: EventStream = field(default_factory=EventStream)
    error: BaseException | None = None
    at: int = 0  # model currently responsible for the request
    seen: list[int] = field(default_factory=list)  # per model: tokens of token_ids it has seen
    local: list[Sequence | None] = field(default_factory=list)  # per model: its engine sequence
    trace: list[int] = field(default_factory=list)  # model index per output token
    state: list[dict[str, Any]] = field(default_factory=list)  # per model: the policy's scratch space
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None

    def __post_init__(self) -> None:
        self.seen = [0] * self.num_models
        self.local = [None] * self.num_models
        self.state = [{} for _ in range(self.num_models)]

    @property
    def token_ids(self) -> list[int]:
        return self.out.token_ids

    @property
    def sampling(self) -> SamplingParams:
        return self.out.sampling

    @property
    def num_prompt_tokens(self) -> int:
        return self.out.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.out.num_output_tokens

    @property
    def finished(self) -> bool:
        return self.out.finished

    def with_text(self, ev: StreamEvent) -> StreamEvent:
        """`ev` with its text. A request's output defers detokenizing (no stop string needs the text
        at commit) to here, where its consumer takes its events, in order and once each: after the
        step that committed them has launched the next, so on a GPU the text is made while the
        device runs. The pieces are the ones the commit would have made (OutputStream.text_of)."""
        if ev.text is not None:
            return ev
        return ev._replace(text=self.out.text_of(ev.token_id, ev.finish_reason is not None))

    @property
    def finish_reason(self) -> str | None:
        return self.out.finish_reason


# -- inbox messages (typed objects, dispatched by type; never strings) ---------------------------
class NewRequest(NamedTuple):
    req: RouterRequest


class Handoff(NamedTuple):
    """The requests one step of model `src` handed to this model, each with its policy's PeerReq:
    one message per step and peer, however many requests it carries."""

    reqs: tuple[tuple[RouterRequest, PeerReq], ...]
    src: int


class Release(NamedTuple):
    """The request is over (finished, aborted or failed): free or cache its KV here."""

    req: RouterRequest


class Wake(NamedTuple):
    """Something system-wide changed (the active count, the thresholds, a round): re-check launching."""
