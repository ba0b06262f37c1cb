"""One model's subserver: an asyncio task with its own engine (KV pool, prefix cache, scheduler) and
worker thread (its CUDA stream on GPU). It never waits for another model: peers reach it only through
its inbox, and the launch decision it shares with them lives in `LaunchControl`.

A step is the engine's (`Engine.step_async`): schedule, the forward in this model's worker thread,
finish, then the policy routes the batch (`Routing.route`: each request stays or is handed off with
the policy's `PeerReq`) and the engine commits the tokens that stay. The subserver publishes what
the step reports (the request table streams it) and counts it. When to step is
`LaunchControl.decide`'s answer: the subserver holds no launch state of its own.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Callable

import torch

from aiorouter.launch import LaunchControl
from aiorouter.metrics import ModelMetrics
from aiorouter.request import Handoff, NewRequest, Release, RouterError, RouterRequest, Wake
from aiorouter.requests import RequestTable
from aiorouter.routing import RouteObserver, Routing
from aiorouter.tuning.learned import StepSpan
from engines import Engine
from engines.engine import StepReport
from engines.runner import ForwardOutput, ScheduledSeq
from engines.worker import Worker
from policies.base import PeerReq

log = logging.getLogger("aiorouter.subserver")

StepObserver = Callable[[int, StepSpan, float, float], None]  # (model, its forward's span, seconds of loop work around it, of the hop)
# a batch's forward in the worker thread (on CUDA the runner launches on the model's own stream(s)
# and waits for the step's event there, so the loop and the other models' steps go on meanwhile)
StepFn = Callable[[list[ScheduledSeq]], ForwardOutput]


class Subserver:
    def __init__(self, index: int, name: str, engine: Engine, launch: LaunchControl, requests: RequestTable,
                 num_threads: int, step_fn: StepFn | None = None, reserved_rows: int = 0,
                 observe: RouteObserver | None = None, observe_step: StepObserver | None = None):
        """`step_fn`: the forward as the worker runs it (`Engine.execute`'s signature; the router
        builds it, see Router._step_fn); None: the engine's own. `reserved_rows`: output rows past
        the shared vocabulary (the policy's, never sampled)."""
        self.index, self.name, self.engine = index, name, engine
        self.launch, self.requests, self.observe, self.observe_step = launch, requests, observe, observe_step
        self.metrics = ModelMetrics(kv_pages_total=engine.kv_usage().pages_total)
        # One worker thread per model: forwards of different models overlap while the event
        # loop stays free. Its intra-op thread count is set inside that thread (per-thread in OpenMP).
        self.worker = Worker(f"aiorouter-{name}", torch.set_num_threads, (num_threads,))
        self.forward = step_fn or engine.execute
        self.routing = Routing(index, name, engine, launch, requests, engine.model_config.vocab_size - reserved_rows,
                               self.worker, observe)

    # -- inbox -------------------------------------------------------------------------------
    def handle(self, msg: object) -> None:
        """One inbox message. A request that cannot be admitted or resumed here fails alone; a
        Release that fails is the engine's state gone wrong, which ends this subserver's task (the
        router then fails every request and restarts it with a fresh engine state)."""
        if isinstance(msg, NewRequest):
            self._take(msg.req, None)
        elif isinstance(msg, Handoff):
            for req, pr in msg.reqs:
                self._take(req, pr)
        elif isinstance(msg, Release):
            seq = msg.req.local[self.index]
            if seq is not None and not seq.is_finished:
                self.engine.release(seq, msg.req.finish_reason or "abort")
        elif not isinstance(msg, Wake):
            raise TypeError(f"subserver {self.name}: unknown message {type(msg).__name__}")

    def _take(self, req: RouterRequest, pr: PeerReq | None) -> None:
        """A new request (`pr` None) or one a peer handed here arrives; failing, it fails alone."""
        try:
            if pr is None:
                self.routing.arrive(req, req.token_ids[:])
            else:
                self.routing.receive(req, pr)
        except Exception as e:
            log.warning("model %s: request %s failed on arrival: %r", self.name, req.rid, e)
            self.requests.fail(req, RouterError(f"model {self.name!r} could not take this request: {e!r}"))

    def drain(self) -> None:
        """Handle every message waiting (and those handling them posts here), then report."""
        while msgs := self.launch.take(self.index):
            for msg in msgs:
                self.handle(msg)
        self._report()

    def reset(self) -> None:
        """After this subserver's task died, before a new one runs: a fresh engine state (weights
        kept) and an empty inbox. The router has failed every request first, so nothing that
        either held is still wanted."""
        self.launch.reset(self.index)
        self.engine.reset()
        self._report()

    # -- one step ----------------------------------------------------------------------------
    async def step(self, since: float | None = None) -> bool:
        """Schedule, run and route one batch. False when nothing could be scheduled. `since`: when
        the loop's work towards this step began (the messages that made it ready, handled first)."""
        with self.launch.stepping(self.index):
            return await self._step(since or time.perf_counter())

    async def _step(self, since: float) -> bool:
        report = None
        try:
            report = await self.engine.step_async(self.worker, self.routing.route, self.forward)
            if report is None:
                return False
            self._fail(report)
            if report.commits:
                # Overlap: the step's tokens go out to their requests once this subserver has
                # launched its next step (a callback runs when this task next waits, on the worker),
                # so on a GPU streaming them costs the device no time. The engine has committed them
                # already: what the next step computes does not depend on their publishing.
                asyncio.get_running_loop().call_soon(self._publish, report)
            return True
        finally:
            self._report()
            if report is not None:
                self._count(report, since)

    def _fail(self, report: StepReport) -> None:
        """A sequence that failed its step alone, or whose logits were NaN/inf, fails its request."""
        for seq, e in report.failed:
            req = seq.user_data
            log.warning("model %s: a step failed for request %s: %r", self.name, req.rid, e)
            self.requests.fail(req, RouterError(f"model {self.name!r} failed a step: {e!r}"))
        for seq in report.bad:
            req = seq.user_data
            self.requests.fail(req, RouterError(
                f"model {self.name!r} produced non-finite logits (NaN or inf) for this request at output "
                f"token {req.num_output_tokens}; the request is stopped"))

    def _publish(self, report: StepReport) -> None:
        """Each token the step committed (or its stream refused) goes out to its request."""
        kept = 0
        # (None for every token when no row asked: a zip with `repeat` costs ~30 ns a token)
        lps = report.logprobs if report.logprobs is not None else itertools.repeat(None)
        for (seq, token, c), lp in zip(report.commits, lps):
            req = seq.user_data
            if isinstance(c, Exception):
                self.requests.failed_commit(req, token, self.index, c)
                continue
            req.seen[self.index] = len(seq.token_ids)
            self.requests.publish(req, token, c, self.index, lp)
            kept += 1
        if self.observe is not None and kept:  # the step's stays: a decision and a token each, told once
            self.observe(self.index, self.index, kept, kept)

    def _count(self, report: StepReport, since: float) -> None:
        for wait in report.waits:
            self.metrics.record_admission(wait)
        if report.spans:  # one step, however many parts isolation ran it in
            self.metrics.record_step(sum(s.batch for s in report.spans), report.finished - report.launched)
        if len(report.spans) == 1:  # (a step rerun in parts is not a step's cost)
            # What this step cost beyond its forward: the loop's work before the hop to the worker
            # and after it, and the hop each way. The tuner's start-up profile times the forward and
            # the hop; the loop's work is the rest (observe_step). The forward's own span, with the
            # others', says how much the models slowed each other while serving
            # (aiorouter.tuning.learned).
            span = StepSpan(*report.spans[0])
            loop = (report.launched - since) + (time.perf_counter() - report.returned)
            hop = (report.returned - report.launched) - span.seconds
            self.metrics.record_overhead(loop, hop)
            self.metrics.record_span(span)
            if self.observe_step is not None:
                self.observe_step(self.index, span, loop, hop)

    def _report(self) -> None:
        # (the KV gauges are read when asked: Router.kv_usage; a KVUsage per step cost ~5 us)
        self.launch.set_ready(self.index, self.engine.num_ready)

    # -- the loop (every mode: LaunchControl decides) --------------------------------------------
    async def run(self) -> None:
        since = time.perf_counter()  # the loop's work towards the next step began (see step)
        while True:
            self.drain()
            go = self.launch.decide(self.index)
            if go.now and await self.step(since):
                since = time.perf_counter()
                continue
            if not await self.launch.wait(self.index, go.wait_s):  # the max-wait bound: launch what is here
                await self.step()
            since = time.perf_counter()

    def close(self) -> None:
        self.worker.shutdown(wait=True, cancel_futures=True)
