"""Launch control: when each model may launch its next step, and the inboxes that wake it.

One object, handed by the router to every subserver, owns what the launch decision reads across
models: the inboxes (a handoff is a post to the peer's), messages posted and not yet handled,
models inside a step, each model's ready count, the delayed-batching thresholds, stalls and kicks,
and step-sync's rounds. All of it runs on the event loop; nothing here blocks.

A subserver asks one question, `decide`: may it launch now, or how long should it wait for a
message first. Around it, it takes its messages (`take`, `wait`), reports what it has ready
(`set_ready`) and brackets its steps (`stepping`); everything else stays in here.

Modes (one subserver loop serves all three):
- `eager`: launch whenever something is ready.
- `delayed`: launch at B_i ready requests, or when every active request is already here (nothing
  else can arrive), or when kicked out of a stall.
- `sync`: step-sync rounds. A round opens when no model is stepping and no message is in flight;
  its members are the models with ready work at that moment, and the next round waits for all of them.

In `delayed` mode the tuner may name, per concurrency N, a schedule other than delayed(B): eager or
sync, whichever the throughput model predicts best (`set_schedule`). The decision then reads the
mode for the current active count (`mode_now`). A switch never strands a model: members of an open
sync round still launch whatever the mode has become, a switch wakes every model so it re-decides,
and a sync round opens only once no model is stepping, so steps begun under another mode finish first.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import Iterator, Mapping, NamedTuple

from aiorouter.request import Handoff, NewRequest, Wake

MODES = ("delayed", "eager", "sync")


def parse_thresholds(spec: object, names: list[str], max_concurrency: int) -> dict[int, tuple[int, ...]] | None:
    """A dict model -> B (any concurrency) or N -> {model: B}; None means "ask the tuner"."""
    if spec in ("auto", None):
        return None
    if not isinstance(spec, Mapping) or not spec:
        raise ValueError(f"thresholds must be 'auto', a dict model->B, or a dict N->{{model: B}}; got {spec!r}")

    def vector(d: Mapping) -> tuple[int, ...]:
        unknown = [k for k in d if k not in names]
        if unknown:
            raise ValueError(f"thresholds name unknown model {unknown[0]!r}; models: {', '.join(names)}")
        b = tuple(int(d.get(n, 1)) for n in names)
        if any(x < 1 for x in b):
            raise ValueError(f"thresholds must be >= 1, got {dict(zip(names, b))}")
        return b

    if all(isinstance(k, str) for k in spec):
        b = vector(spec)
        return {n: b for n in range(1, max_concurrency + 1)}
    if all(isinstance(k, int) for k in spec):
        table = {int(n): vector(d) for n, d in spec.items()}
        return {n: table[max([k for k in table if k <= n], default=min(table))] for n in range(1, max_concurrency + 1)}
    raise ValueError("thresholds keys must be all model names or all concurrency levels")


def should_launch(ready: int, threshold: int, num_active: int) -> bool:
    """Launch at `threshold` ready requests, or when every active request is already here:
    then nothing else can arrive, and waiting would deadlock."""
    return ready > 0 and (ready >= threshold or ready >= num_active)


class Decision(NamedTuple):
    """`LaunchControl.decide`'s answer for one model."""

    now: bool  # launch a step now
    # otherwise (or when the launch found nothing to run): wait this long for a message, then
    # launch what is here (the max-wait bound); None: wait for a message however long it takes
    wait_s: float | None


class LaunchControl:
    def __init__(self, mode: str, num_models: int, max_concurrency: int,
                 thresholds: Mapping[int, tuple[int, ...]] | None = None, max_wait_s: float | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
        self.mode, self.num_models, self.max_concurrency, self.max_wait_s = mode, num_models, max_concurrency, max_wait_s
        self._inboxes: list[collections.deque] = [collections.deque() for _ in range(num_models)]
        self._arrived = [asyncio.Event() for _ in range(num_models)]  # set when a message is posted
        self.table: dict[int, tuple[int, ...]] = dict(thresholds or {n: (1,) * num_models
                                                                     for n in range(1, max_concurrency + 1)})
        # per N: the schedule run at that active count (only `delayed` mode varies it; see set_schedule)
        self.modes: dict[int, str] = {n: mode for n in range(1, max_concurrency + 1)}
        self.mode_now = mode  # the mode at the current active count
        self.num_active = 0  # requests in the system (the closed-loop N the thresholds are solved for)
        self.ready = [0] * num_models  # per model: sequences a step could compute, as last reported
        self.busy = 0  # models inside a step
        self.in_flight = 0  # NewRequest / Handoff messages posted and not yet handled
        self.kicked = [False] * num_models
        self.round: set[int] = set()  # sync: members of the current round that have not launched yet

    # -- inboxes ---------------------------------------------------------------------------------
    def post(self, model: int, msg: object) -> None:
        if isinstance(msg, (NewRequest, Handoff)):
            self.in_flight += 1
        self._inboxes[model].append(msg)
        self._arrived[model].set()

    def take(self, model: int) -> list[object]:
        """Every message waiting for `model`, in order, taken out of its inbox. They count as
        handled now: the subserver handles them and reports its ready count before it next awaits,
        so no other model can decide in between."""
        inbox = self._inboxes[model]
        if not inbox:
            return []
        msgs = list(inbox)
        inbox.clear()
        self.in_flight -= sum(isinstance(m, (NewRequest, Handoff)) for m in msgs)
        return msgs

    async def wait(self, model: int, timeout: float | None) -> bool:
        """Wait until a message for `model` is posted (True) or `timeout` seconds pass (False)."""
        if self._inboxes[model]:
            return True
        arrived = self._arrived[model]
        arrived.clear()
        try:
            await asyncio.wait_for(arrived.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def reset(self, model: int) -> list[object]:
        """`model`'s subserver died and restarts: its inbox is emptied (the messages name requests
        the router has failed, and sequences of the engine state it drops) -> those messages. It
        has nothing ready, is owed by no round, and is not kicked."""
        dropped = self.take(model)
        self.kicked[model] = False
        self.set_ready(model, 0)
        return dropped

    def wake_all(self, but: int | None = None) -> None:
        for i in range(self.num_models):
            if i != but:
                self.post(i, Wake())

    # -- state the subservers and the request table report -----------------------------------------
    def set_ready(self, model: int, n: int) -> None:
        self.ready[model] = n
        if n == 0 and model in self.round:
            # a member left with nothing to step (its requests were aborted) would hold the round
            # open forever, the others waiting on it: it leaves the round, and if it was the last
            # one owed, the round is over
            self.round.discard(model)
            if not self.round and self.busy == 0:
                self.wake_all(but=model)

    def set_active(self, n: int) -> None:
        """The active count changed: every threshold, and the schedule, may have changed with it."""
        if n != self.num_active:
            old = self._key(self.num_active)
            self.num_active = n
            self.mode_now = self.mode_at(n)
            # delayed reads the count itself (all active requests here: launch), the others only
            # through their schedule
            if self.mode == "delayed" and (self.mode_now == "delayed" or self._key(n) != old):
                self.wake_all()

    def _key(self, n: int) -> tuple:
        k = min(max(1, n), self.max_concurrency)
        return self.modes[k], self.table[k]

    def set_schedule(self, table: Mapping[int, tuple[int, ...]], modes: Mapping[int, str] | None) -> None:
        """Thresholds per N and, in `delayed` mode, the schedule per N: "delayed" (with those
        thresholds), "eager" or "sync". An N missing from `modes` runs delayed."""
        if modes is not None and self.mode != "delayed":
            raise ValueError(f"a schedule per concurrency applies to delayed mode only (this router runs {self.mode!r})")
        bad = [m for m in (modes or {}).values() if m not in MODES]
        if bad:
            raise ValueError(f"unknown mode {bad[0]!r} in the schedule; use one of {', '.join(MODES)}")
        self.table = dict(table)
        if modes is not None:
            self.modes = {n: modes.get(n, "delayed") for n in range(1, self.max_concurrency + 1)}
        self.mode_now = self.mode_at(self.num_active)
        self.wake_all()

    def mode_at(self, n: int) -> str:
        return self.modes[min(max(1, n), self.max_concurrency)]

    def threshold(self, model: int) -> int:
        return self.table[min(max(1, self.num_active), self.max_concurrency)][model]

    def thresholds_at(self, n: int) -> tuple[int, ...]:
        return self.table[min(max(1, n), self.max_concurrency)]

    # -- the decision ----------------------------------------------------------------------------
    def decide(self, model: int) -> Decision:
        """May `model` launch a step now (by its mode, an open sync round, or as the one kicked out
        of a stall), and how long it waits for a message when it does not."""
        return Decision(self.may_launch(model) or self._kick_if_stalled(model), self._wait_bound(model))

    @contextlib.contextmanager
    def stepping(self, model: int) -> Iterator[None]:
        """`model` is inside a step (launched or not: it may find nothing to run)."""
        self.started(model)
        try:
            yield
        finally:
            self.ended(model)

    def may_launch(self, model: int) -> bool:
        ready = self.ready[model]
        if ready == 0:
            return False
        mode = self.mode_now
        if mode == "eager" or self.kicked[model] or model in self.round:  # an open round finishes in any mode
            return True
        if mode == "delayed":
            return should_launch(ready, self.threshold(model), self.num_active)
        if not self.round and self.busy == 0 and self.in_flight == 0:  # sync: open the next round
            self.round = {i for i, r in enumerate(self.ready) if r > 0}
            for i in self.round - {model}:
                self.post(i, Wake())
            return True
        return False

    def started(self, model: int) -> None:
        self.busy += 1
        self.kicked[model] = False
        self.round.discard(model)

    def ended(self, model: int) -> None:
        self.busy -= 1
        if self.mode_now == "sync" and self.busy == 0 and not self.round:
            self.wake_all(but=model)  # the round is over: whoever has work may open the next

    def _kick_if_stalled(self, model: int) -> bool:
        """Delayed mode, `model` waits below its threshold: if no model is stepping and nothing is in
        flight, nothing changes unless someone launches, so the model with the most ready requests
        does (the active count can fall below what the thresholds were solved for as load drains).
        True when that is `model` itself."""
        if self.mode_now != "delayed" or self.busy or self.in_flight or not self.ready[model]:
            return False
        best = max(range(self.num_models), key=lambda i: (self.ready[i], -i))
        self.kicked[best] = True
        if best != model:
            self.post(best, Wake())
        return best == model

    def _wait_bound(self, model: int) -> float | None:
        """How long `model` may wait on its inbox: the max-wait bound while requests wait below a threshold."""
        return self.max_wait_s if self.mode_now == "delayed" and self.ready[model] and self.max_wait_s else None
