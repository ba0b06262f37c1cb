"""One model's subserver: an asyncio task with its own engine (KV pool, prefix cache, scheduler) and
worker thread (its CUDA stream on GPU). It never waits for another model: peers reach it only through
its inbox, and the launch decision it shares with them lives in `LaunchControl`.

A step is schedule -> execute (in the worker thread) -> finish, then the policy routes the batch:
each request stays or is handed off with the policy's `PeerReq`. The engine commits the tokens that
stay, all of a step's in one call (`Engine.commit`); the request table streams them. When to step
is `LaunchControl.decide`'s answer: the subserver holds no launch state of its own.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from aiorouter.launch import LaunchControl
from aiorouter.metrics import ModelMetrics
from aiorouter.request import Handoff, NewRequest, Release, RouterError, RouterRequest, Wake
from aiorouter.requests import RequestTable
from aiorouter.tuning.learned import StepSpan
from engines import Engine, Sequence
from engines.runner import ForwardOutput, ScheduledSeq
from policies.base import STAY, PeerReq, Policy, ReqView, StepResult

log = logging.getLogger("aiorouter.subserver")

RouteObserver = Callable[[int, int, int], None]  # (from model, to model, tokens committed)
StepObserver = Callable[[int, StepSpan, float, float], None]  # (model, its forward's span, seconds of loop work around it, of the hop)
StepFn = Callable[[list[ScheduledSeq], bool], ForwardOutput]  # (batch, want hidden) -> output


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
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"aiorouter-{name}",
                                           initializer=torch.set_num_threads, initargs=(num_threads,))
        self._execute = step_fn or engine.execute
        self.vocab_size = engine.model_config.vocab_size - reserved_rows  # the rows that are tokens

    async def in_worker(self, fn: Callable, *args):
        """Run fn(*args) in this model's worker thread (profiling runs where the model serves)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # -- inbox -------------------------------------------------------------------------------
    def handle(self, msg: object) -> None:
        """One inbox message. A request that cannot be admitted or resumed here fails alone; a
        Release that fails is the engine's state gone wrong, which ends this subserver's task (the
        router then fails every request and restarts it with a fresh engine state)."""
        if isinstance(msg, (NewRequest, Handoff)):
            try:
                self._arrive(msg.req, msg.req.token_ids[:]) if isinstance(msg, NewRequest) else self._receive(msg)
            except Exception as e:
                log.warning("model %s: request %s failed on arrival: %r", self.name, msg.req.rid, e)
                self.requests.fail(msg.req, RouterError(f"model {self.name!r} could not take this request: {e!r}"))
        elif isinstance(msg, Release):
            seq = msg.req.local[self.index]
            if seq is not None and not seq.is_finished:
                self.engine.release(seq, msg.req.finish_reason or "abort")
        elif not isinstance(msg, Wake):
            raise TypeError(f"subserver {self.name}: unknown message {type(msg).__name__}")

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

    def _view(self, req: RouterRequest, sampled: int | None = None, peer: int | None = None) -> ReqView:
        return ReqView(req.rid, self.index, req.token_ids, req.num_prompt_tokens, sampled, tuple(req.seen),
                       tuple(req.trace), req.state[self.index], peer)

    def _receive(self, msg: Handoff) -> None:
        req, pr = msg.req, msg.peer_req
        if req.finished:
            return
        try:
            tokens = list(req.policy.receive(pr, self._view(req)))
            seen = req.seen[self.index]
            if tokens != req.token_ids[seen:seen + len(tokens)]:
                raise RouterError(f"policy {req.policy.name!r}.receive on {self.name!r} returned tokens that are not "
                                  f"the request's committed tokens from position {seen}")
        except Exception as e:  # a policy bug fails this request only
            self.requests.fail(req, e if isinstance(e, RouterError) else
                               RouterError(f"policy {req.policy.name!r} raised in receive on model {self.name!r}: {e!r}"))
            return
        self._arrive(req, tokens)

    def _arrive(self, req: RouterRequest, tokens: list[int]) -> None:
        """The request is now this model's: its engine takes what it has not seen and makes it ready."""
        if req.finished:
            return
        req.at = self.index
        seq = req.local[self.index]
        if seq is None:  # first visit: prefix matching and admission
            seq = req.local[self.index] = self.engine.add(tokens, req.sampling, req.num_prompt_tokens,
                                                          user_data=req, output=req.out)
        else:  # handoff-resume: KV kept, just extend
            self.engine.resume(seq, tokens)
        req.seen[self.index] = len(seq.token_ids)

    # -- one step ----------------------------------------------------------------------------
    async def step(self, since: float | None = None) -> bool:
        """Schedule, run and route one batch. False when nothing could be scheduled. `since`: when
        the loop's work towards this step began (the messages that made it ready, handled first)."""
        with self.launch.stepping(self.index):
            return await self._step(since or time.perf_counter())

    async def _step(self, since: float) -> bool:
        parts: list[tuple[list[ScheduledSeq], ForwardOutput, StepSpan]] = []
        t0 = t_back = since
        try:
            batch = self.engine.schedule()
            if not batch:
                return False
            t0 = time.perf_counter()
            for wait in self.engine.waits(batch, t0):
                self.metrics.record_admission(wait)
            parts = await self._isolating(batch)
            t_back = time.perf_counter()
            for part, out, _ in parts:
                self.engine.finish(part, out)
            if parts:  # one step, however many parts isolation ran it in
                self.metrics.record_step(sum(len(p) for p, _, _ in parts), time.perf_counter() - t0)
            for _, out, _ in parts:
                for row in out.bad_rows:
                    req = out.seqs[row].user_data
                    self.requests.fail(req, RouterError(
                        f"model {self.name!r} produced non-finite logits (NaN or inf) for this request at output "
                        f"token {req.num_output_tokens}; the request is stopped"))
                await self.route(out)
            return True
        finally:
            self._report()
            if len(parts) == 1:  # (a step rerun in parts is not a step's cost)
                # What this step cost beyond its forward: the loop's work before the hop to the
                # worker and after it, and the hop each way. The tuner's start-up profile times
                # the forward and the hop; the loop's work is the rest (observe_step). The
                # forward's own span, with the others', says how much the models slowed each
                # other while serving (aiorouter.tuning.learned).
                span = parts[0][2]
                loop, hop = (t0 - since) + (time.perf_counter() - t_back), (t_back - t0) - span.seconds
                self.metrics.record_overhead(loop, hop)
                self.metrics.record_span(span)
                if self.observe_step is not None:
                    self.observe_step(self.index, span, loop, hop)

    async def _isolating(self, batch: list[ScheduledSeq]) -> list[tuple[list[ScheduledSeq], ForwardOutput, StepSpan]]:
        """Run the batch -> [(part, its output, when the worker ran it)]. A step that raises is run
        again in halves, so a sequence that makes steps fail fails alone (about 2*log2(B) extra
        steps for one such sequence in a batch of B) and the rest of the batch goes on. Rerunning is sound: a step
        that raised committed nothing (`finish` did not run), so its sequences compute the same
        positions again and rewrite their K/V slots with the same values. (A seeded sampled
        request that is rerun draws again, so its tokens are then not batch-independent.)"""
        try:
            return [(batch, *await self._run(batch))]
        except Exception as e:
            if len(batch) == 1:
                req = batch[0].seq.user_data
                log.warning("model %s: a step failed for request %s: %r", self.name, req.rid, e)
                self.requests.fail(req, RouterError(f"model {self.name!r} failed a step: {e!r}"))
                return []
            log.exception("model %s: a step of %d sequences failed; running it in halves to isolate the cause",
                          self.name, len(batch))
        half = len(batch) // 2
        return await self._isolating(batch[:half]) + await self._isolating(batch[half:])

    async def _run(self, batch: list[ScheduledSeq]) -> tuple[ForwardOutput, StepSpan]:
        """The forward in this model's worker thread -> (output, when it ran there). On CUDA the
        runner launches on the model's own stream(s) and waits for the step's event in that thread,
        so the loop and the other models' steps go on meanwhile (engines/runner.py)."""
        want_hidden = any(s.user_data.policy.needs_hidden for s, _ in batch)
        return await self.in_worker(self._timed_execute, batch, want_hidden)

    def _timed_execute(self, batch: list[ScheduledSeq], want_hidden: bool) -> tuple[ForwardOutput, StepSpan]:
        t = time.perf_counter()
        out = self._execute(batch, want_hidden)
        return out, StepSpan(t, time.perf_counter(), len(batch), sum(n for _, n in batch))

    async def route(self, out: ForwardOutput) -> None:
        """The policy decides per request; requests with a per-request policy are routed apart.
        The tokens that stay are committed by the engine in one call, then published."""
        groups: dict[int, list[int]] = {}
        for row, seq in enumerate(out.seqs):
            if not seq.user_data.finished:
                groups.setdefault(id(seq.user_data.policy), []).append(row)
        stays: list[tuple[Sequence, int]] = []
        for rows in groups.values():
            policy = out.seqs[rows[0]].user_data.policy
            for req, d, view in await self._decide(policy, out, rows):
                if req.finished:  # ended while an isolating re-route ran (a client gone)
                    continue
                if d == STAY:
                    stays.append((req.local[self.index], view.sampled))
                else:
                    self._hand_off(policy, req, d, view)
        if stays:
            self._keep(stays)

    async def _decide(self, policy: Policy, out: ForwardOutput, rows: list[int]) -> list[tuple[RouterRequest, int, ReqView]]:
        """`policy.route` for these rows -> (request, destination, view) each. When route raises for
        the batch, it is asked again for each request alone, so the request that makes it raise
        fails alone and the others go on (route sees each of them once more)."""
        reqs: list[RouterRequest] = [out.seqs[r].user_data for r in rows]
        logits, hidden = self._rows(out, rows)
        V = self.vocab_size  # rows past V: reserved for the policy (a view, no copy)
        result = StepResult(self.index, logits[:, :V], torch.tensor([out.next_tokens[r] for r in rows]), hidden,
                            [self._view(q, out.next_tokens[r]) for q, r in zip(reqs, rows)],
                            logits[:, V:] if logits.shape[-1] > V else None)
        try:
            dests = await self.in_worker(policy.route, result) if policy.route_in_worker else policy.route(result)
            dests = [int(d) for d in (dests.tolist() if hasattr(dests, "tolist") else dests)]
            if len(dests) != len(rows):
                raise RouterError(f"policy {policy.name!r}.route returned {len(dests)} destinations "
                                  f"for a batch of {len(rows)}")
        except Exception as e:
            if len(rows) > 1:
                return [x for r in rows if not out.seqs[r].user_data.finished
                        for x in await self._decide(policy, out, [r])]
            self.requests.fail(reqs[0], e if isinstance(e, RouterError) else
                               RouterError(f"policy {policy.name!r} raised in route on model {self.name!r}: {e!r}"))
            return []
        return list(zip(reqs, dests, result.reqs))

    @staticmethod
    def _rows(out: ForwardOutput, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's logits [len(rows), V] and hidden states for `rows`: the output itself when they
        are the whole batch, else `index_select`. Not `logits[idx]`: advanced indexing opens a parallel
        region even for a few rows, on the event loop thread's default OpenMP team (every core), and
        waits at its barrier for a core another model's worker holds. On the shared 2-core machine
        that was 20 ms median for a [16, 512] gather, against 3 us for `index_select`; at N = 16 on
        the sim pair it took 70% of the event loop's time."""
        if len(rows) == out.logits.shape[0]:  # rows are in batch order: all of them means the batch
            return out.logits, out.hidden
        idx = torch.tensor(rows)
        return out.logits.index_select(0, idx), out.hidden.index_select(0, idx) if out.hidden is not None else None

    def _keep(self, stays: list[tuple[Sequence, int]]) -> None:
        """Commit the tokens of the requests that stay here (the engine appends them, feeds each
        request's output stream and finishes the ones that stopped), then stream each."""
        for (seq, token), c in zip(stays, self.engine.commit(stays)):
            req = seq.user_data
            if isinstance(c, Exception):
                self.requests.failed_commit(req, token, self.index, c)
                continue
            req.seen[self.index] = len(seq.token_ids)
            if self.observe is not None:
                self.observe(self.index, self.index, 1)
            self.requests.publish(req, token, c, self.index)

    def _hand_off(self, policy: Policy, req: RouterRequest, dest: int, view: ReqView) -> None:
        try:
            peers = policy.peers(self.index)
            if not 1 <= dest <= len(peers):
                raise RouterError(f"policy {policy.name!r} routed to peer {dest} from model {self.name!r}, "
                                  f"which has {len(peers)} peers")
            target = peers[dest - 1]
            pr = policy.send(view._replace(peer=target))
            new = self._check_send(policy, req, pr, target)
        except Exception as e:
            self.requests.fail(req, e if isinstance(e, RouterError) else
                               RouterError(f"policy {policy.name!r} raised in send on model {self.name!r}: {e!r}"))
            return
        if self.observe is not None:
            self.observe(self.index, target, len(new))
        if new:
            self.requests.commit(req, new, self.index)
        if pr.finished:
            self.requests.finish(req)
        if req.finished:
            return
        self.engine.park(req.local[self.index])
        self.requests.count_handoff(self.index, target)
        self.launch.post(target, Handoff(req, pr, self.index))

    @staticmethod
    def _check_send(policy: Policy, req: RouterRequest, pr: PeerReq, target: int) -> list[int]:
        """-> the tokens the send commits. A PeerReq carries the whole suffix the peer has not seen."""
        unseen = req.token_ids[req.seen[target]:]
        if pr.rid != req.rid or pr.loc != len(req.token_ids) or pr.tokens[:len(unseen)] != unseen:
            raise RouterError(f"policy {policy.name!r}.send: a PeerReq must carry request {req.rid}, loc "
                              f"{len(req.token_ids)} (the decoding position) and the {len(unseen)} tokens the peer "
                              f"has not seen from position {req.seen[target]}; got loc {pr.loc}, {len(pr.tokens)} tokens")
        return pr.tokens[len(unseen):]

    def _report(self) -> None:
        n = self.engine.num_ready
        self.launch.set_ready(self.index, n)
        kv = self.engine.kv_usage()
        self.metrics.kv_pages_used, self.metrics.queue_len, self.metrics.pending = kv.pages_used, n, kv.parked

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
        self.executor.shutdown(wait=True, cancel_futures=True)
