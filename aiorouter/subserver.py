"""One model's subserver: an asyncio task with its own engine, KV pool, prefix cache,
scheduler and worker thread (its CUDA stream on GPU). It never waits for another model:
peers reach it only through `inbox`."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from aiorouter.batching import should_launch
from aiorouter.metrics import ModelMetrics
from aiorouter.request import Handoff, Kick, NewRequest, Release, RouterError, RouterRequest, Wake
from engines import Engine, Sequence
from engines.runner import ForwardOutput, ScheduledSeq
from policies.base import ReqView, RouteInput

if TYPE_CHECKING:
    from aiorouter.router import Router

log = logging.getLogger("aiorouter.subserver")


class Subserver:
    def __init__(self, router: "Router", index: int, name: str, engine: Engine, num_threads: int):
        self.router, self.index, self.name, self.engine = router, index, name, engine
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.metrics = ModelMetrics(kv_pages_total=engine.block_manager.num_pages)
        # One worker thread per model: forwards of different models overlap while the event
        # loop stays free. Its intra-op thread count is set inside that thread (per-thread in OpenMP).
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"aiorouter-{name}",
                                           initializer=torch.set_num_threads, initargs=(num_threads,))
        self.task: asyncio.Task | None = None
        self.kicked = False  # the router found the system stalled and chose this model to launch

    @property
    def scheduler(self):
        return self.engine.scheduler

    def post(self, msg: object) -> None:
        if isinstance(msg, (NewRequest, Handoff)):
            self.router._in_flight += 1
        self.inbox.put_nowait(msg)
        self.router._wakeup.set()

    # -- inbox -------------------------------------------------------------------------------
    def handle(self, msg: object) -> None:
        if isinstance(msg, (NewRequest, Handoff)):
            self.router._in_flight -= 1
        if isinstance(msg, Kick):
            self.kicked = True
        elif isinstance(msg, NewRequest):
            self._arrive(msg.req, msg.req.token_ids[:], loc=0)
        elif isinstance(msg, Handoff):
            self._receive(msg)
        elif isinstance(msg, Release):
            self._release(msg.req)
        elif not isinstance(msg, Wake):
            raise TypeError(f"subserver {self.name}: unknown message {type(msg).__name__}")

    def drain(self) -> None:
        while True:
            try:
                msg = self.inbox.get_nowait()
            except asyncio.QueueEmpty:
                return
            self.handle(msg)

    def _receive(self, msg: Handoff) -> None:
        req, pr = msg.req, msg.peer_req
        if req.finished:
            return
        try:
            policy = self.router.policy_for(req)
            if pr.loc != req.seen[self.index]:
                raise RouterError(f"policy {policy.name!r}: PeerReq.loc={pr.loc} but model {self.name!r} has seen "
                                  f"{req.seen[self.index]} tokens")
            tokens = list(policy.receive(self.index, pr))
        except Exception as e:  # a policy bug fails this request only
            self.router.fail(req, e if isinstance(e, RouterError) else RouterError(f"receive failed on {self.name}: {e!r}"))
            return
        self._arrive(req, tokens, pr.loc)

    def _arrive(self, req: RouterRequest, tokens: list[int], loc: int) -> None:
        """The request is now this model's: append what it has not seen and make it ready."""
        if req.finished:
            return
        req.at = self.index
        seq = req.local[self.index]
        if seq is None:
            if loc != 0:
                self.router.fail(req, RouterError(f"first PeerReq to {self.name!r} must start at loc 0, got {loc}"))
                return
            seq = Sequence(tokens, req.sampling, num_prompt_tokens=req.num_prompt_tokens, user_data=req)
            req.local[self.index] = seq
            self.scheduler.add(seq)  # first visit: prefix matching and admission
        else:
            self.scheduler.resume(seq, tokens)  # handoff-resume: KV kept, just extend
        req.seen[self.index] = len(seq.token_ids)
        seq.t_ready = time.perf_counter()

    def _release(self, req: RouterRequest) -> None:
        seq = req.local[self.index]
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, req.finish_reason or "abort")

    # -- stepping ----------------------------------------------------------------------------
    @property
    def num_ready(self) -> int:
        return self.scheduler.num_ready

    def can_launch(self) -> bool:
        r = self.router
        if r.mode != "delayed" or (self.kicked and self.num_ready):
            return self.num_ready > 0
        return should_launch(self.num_ready, r.threshold(self.index), r.num_active)

    async def execute(self, batch: list[ScheduledSeq]) -> ForwardOutput:
        """The forward in this model's worker thread. On CUDA the runner launches on the model's own
        stream(s) and waits for the step's event in that thread, so the loop and the other models'
        steps go on meanwhile (engines/runner.py)."""
        want_hidden = any(self.router.policy_for(s.user_data).needs_hidden for s, _ in batch)
        loop = asyncio.get_running_loop()
        share, run = self.router._core_share, self.engine.runner.run
        if share is not None:
            run = share.step_fn(self.index, run)
        return await loop.run_in_executor(self.executor, run, batch, want_hidden)

    async def step(self) -> bool:
        """Schedule, run and post-process one batch. False when nothing could be scheduled."""
        self.kicked = False
        batch = self.scheduler.schedule()
        if not batch:
            return False
        self.router._busy += 1
        try:
            await self._step(batch)
        finally:
            self.router._busy -= 1
        return True

    async def _step(self, batch: list[ScheduledSeq]) -> None:
        now = time.perf_counter()
        m = self.metrics
        for seq, _ in batch:
            t = getattr(seq, "t_ready", None)
            if t is not None:
                m.admission_delay_sum += now - t
                m.admission_delay_count += 1
                seq.t_ready = None
        try:
            out = await self.execute(batch)
        except Exception as e:
            log.exception("model %s: step failed", self.name)
            for seq, _ in batch:
                self.router.fail(seq.user_data, RouterError(f"model {self.name!r} failed a step: {e!r}"))
            return
        self.scheduler.commit(batch)
        m.steps += 1
        m.batch_sizes[len(batch)] += 1
        m.step_time_sum += time.perf_counter() - now
        await self.postprocess(out)
        self._update_gauges()

    async def postprocess(self, out: ForwardOutput) -> None:
        rows = [i for i, s in enumerate(out.seqs) if not s.user_data.finished]
        if not rows:
            return
        reqs: list[RouterRequest] = [out.seqs[i].user_data for i in rows]
        toks = [out.next_tokens[i] for i in rows]
        # Requests with a per-request policy are routed apart from the router's policy.
        groups: dict[int, list[int]] = {}
        for k, req in enumerate(reqs):
            groups.setdefault(id(self.router.policy_for(req)), []).append(k)
        for ks in groups.values():
            policy = self.router.policy_for(reqs[ks[0]])
            views = [ReqView(reqs[k].rid, reqs[k].token_ids, reqs[k].num_prompt_tokens, toks[k], tuple(reqs[k].seen),
                             tuple(reqs[k].trace), reqs[k].state) for k in ks]
            idx = torch.tensor([rows[k] for k in ks])
            ri = RouteInput(out.logits[idx], torch.tensor([toks[k] for k in ks]),
                            out.hidden[idx] if out.hidden is not None else None, views)
            try:
                if policy.route_in_worker:
                    loop = asyncio.get_running_loop()
                    dests = await loop.run_in_executor(self.executor, policy.route, self.index, ri)
                else:
                    dests = policy.route(self.index, ri)
                dests = [int(d) for d in (dests.tolist() if hasattr(dests, "tolist") else dests)]
                if len(dests) != len(ks):
                    raise RouterError(f"policy {policy.name!r}.route returned {len(dests)} destinations "
                                      f"for a batch of {len(ks)}")
            except Exception as e:
                err = e if isinstance(e, RouterError) else RouterError(f"policy {policy.name!r} raised in route: {e!r}")
                for k in ks:
                    self.router.fail(reqs[k], err)
                continue
            for k, d, view in zip(ks, dests, views):
                self._dispatch(policy, reqs[k], toks[k], d, view)

    def _dispatch(self, policy, req: RouterRequest, token: int, dest: int, view: ReqView) -> None:
        r = self.router
        seq = req.local[self.index]
        if dest == 0:
            r.observe_route(self.index, self.index, 1)
            seq.token_ids.append(token)
            req.seen[self.index] = len(seq.token_ids)
            seq.t_ready = time.perf_counter()
            r.commit(req, [token], self.index)
            return
        try:
            target = policy.resolve(self.index, dest)
            pr = policy.send(self.index, view, target)
            committed = len(req.token_ids) - pr.loc
            if pr.loc != req.seen[target] or pr.tokens[:committed] != req.token_ids[pr.loc:]:
                raise RouterError(f"policy {policy.name!r}.send: PeerReq must carry the suffix from loc "
                                  f"{req.seen[target]} the peer has not seen (got loc {pr.loc})")
        except Exception as e:
            r.fail(req, e if isinstance(e, RouterError) else RouterError(f"handoff from {self.name!r} failed: {e}"))
            return
        new = pr.tokens[committed:]
        r.observe_route(self.index, target, len(new))
        if new:
            r.commit(req, new, self.index)
            if req.finished:
                return
        self.scheduler.park(seq)
        r.metrics.handoffs[(self.name, r.names[target])] += 1
        r.subservers[target].post(Handoff(req, pr, self.index))

    def _update_gauges(self) -> None:
        m, bm = self.metrics, self.engine.block_manager
        m.kv_pages_used = bm.num_used_pages
        m.queue_len = self.scheduler.num_ready
        m.pending = len(self.scheduler.parked)

    # -- the loop (eager and delayed modes) ------------------------------------------------------
    async def run(self) -> None:
        r = self.router
        while True:
            self.drain()
            self._update_gauges()
            if self.can_launch():
                if await self.step():
                    continue
            elif self.num_ready and r.stalled() and r.kick() is self:
                continue
            timeout = r.max_wait_s if (r.mode == "delayed" and self.num_ready and r.max_wait_s) else None
            try:
                msg = await asyncio.wait_for(self.inbox.get(), timeout)
            except asyncio.TimeoutError:  # max-wait bound: launch what is here
                if self.num_ready:
                    await self.step()
                continue
            self.handle(msg)

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
