"""Std. Serving, the paper's baseline (section 5.1): one standard single-model server per model,
and an outside dispatcher that routes every token between them.

* `EngineServer` -- a single-model server: the project's `engines.Engine` (continuous batching, its
  own prefix cache) stepped by an asyncio task in its own worker thread. Every call is a fresh
  request (`max_tokens=1`, the whole sequence so far): admitted, prefix-matched, extended over the
  tokens its cache lacks, sampled once and released (its full pages stay cached). It times each
  phase of its steps for the paper's Table 10 breakdown (`PhaseTimes`).
* `TokenDispatcher` -- the outside dispatcher: per token it asks the server of the model the
  request is on, applies the project's own `Policy` to the reply (route, then send and receive on
  a move; policies/base.py) as the runtime's subserver does after a step, and asks the chosen
  server next. Any policy therefore routes alike here and in aiorouter.
* `StdServing` -- both servers in this process (std-serving-inproc). std-serving-http puts each
  `EngineServer` in its own process behind HTTP (bench/token_server.py), same dispatcher.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import AsyncIterator, Mapping, NamedTuple, Protocol, Sequence

import torch

from aiorouter.cpu_threads import CoreShare, plan_threads
from aiorouter.spec import ModelSpec
from engines import Engine, SamplingParams
from policies.base import STAY, Policy, ReqView, StepResult

NO_LOGITS = torch.empty(1, 0)  # [1, 0]: the policy declared it reads none, so none were fetched


class TokenReply(NamedTuple):
    token: int
    logits: torch.Tensor | None  # [vocab] float32, when asked for
    hidden: torch.Tensor | None  # [hidden] float32, when asked for


class TokenServer(Protocol):
    """What the dispatcher needs of a model's server: one fresh request per token."""

    name: str

    async def next_token(self, ids: list[int], logits: bool, hidden: bool) -> TokenReply: ...


@dataclass
class PhaseTimes:
    """Where a server's time goes: sums in seconds, per request or per step as named."""

    requests: int = 0
    steps: int = 0
    batch_rows: int = 0  # sequences over all steps (mean batch = batch_rows / steps)
    served_s: float = 0.0  # per request: arrival -> its reply (the queue, its step, the loop's wake-up)
    queue_s: float = 0.0  # per request: arrival -> the start of the step it rides in
    admit_s: float = 0.0  # per step: Engine.add + Engine.schedule (admission, prefix matching, KV pages)
    forward_s: float = 0.0  # per step: Engine.execute (forward and sampling; a sim step's sleep)
    kv_s: float = 0.0  # per step: Engine.finish + Engine.release (KV commit, pages into the prefix cache)

    def minus(self, before: "PhaseTimes") -> "PhaseTimes":
        return PhaseTimes(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})


@dataclass(eq=False)
class _Call:
    ids: list[int]
    logits: bool
    hidden: bool
    fut: asyncio.Future
    t_arrival: float = field(default_factory=time.perf_counter)


class EngineServer:
    """One model served one token per request, with continuous batching: calls that arrive while a
    step runs are admitted together at the next one."""

    def __init__(self, name: str, engine: Engine, threads: int = 1):
        self.name, self.engine = name, engine
        self.params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.times = PhaseTimes()
        # intra-op threads are per thread in OpenMP: set inside the worker that steps
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"std-{name}", initializer=torch.set_num_threads,
                                           initargs=(threads,))
        self._pending: list[_Call] = []
        self._running: dict[int, _Call] = {}  # seq_id -> call, touched only by the worker thread
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._run_step = self._step

    async def start(self, share: CoreShare | None = None, index: int = 0) -> "EngineServer":
        """`share`: cores lent between in-process servers as in the router (this one is model `index`)."""
        if share is not None:
            self._run_step = share.step_fn(index, self._step)
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name=f"std-{self.name}")
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.executor.shutdown(wait=True, cancel_futures=True)

    @property
    def idle(self) -> bool:
        return not self._pending and not self.engine.has_unfinished()

    async def next_token(self, ids: list[int], logits: bool = False, hidden: bool = False) -> TokenReply:
        call = _Call(ids, logits, hidden, asyncio.get_running_loop().create_future())
        self._pending.append(call)
        self._wake.set()
        return await call.fut

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.idle:
                self._wake.clear()
                await self._wake.wait()
                continue
            pending, self._pending = self._pending, []
            try:
                done = await loop.run_in_executor(self.executor, self._run_step, pending)
            except Exception as e:  # fail every caller rather than hang them
                for call in pending + list(self._running.values()):
                    if not call.fut.done():
                        call.fut.set_exception(e)
                self._running.clear()
                continue
            now = time.perf_counter()
            for call, tok, lg, hd in done:
                if not call.fut.done():
                    self.times.served_s += now - call.t_arrival
                    call.fut.set_result(TokenReply(tok, lg, hd))

    def _step(self, pending: list[_Call], layer_hook=None) -> list[tuple[_Call, int, torch.Tensor | None, torch.Tensor | None]]:
        """In the worker thread (the event loop never touches the engine): admit the new calls, run
        one continuous-batching step, release every sequence that got its token. `layer_hook`: the
        heavy model's, from CoreShare.step_fn (as the router's subservers step)."""
        eng, t = self.engine, self.times
        t0 = time.perf_counter()
        for call in pending:
            self._running[eng.add(call.ids, self.params).seq_id] = call
            t.queue_s += t0 - call.t_arrival
        t.requests += len(pending)
        batch = eng.schedule()
        t1 = time.perf_counter()
        t.admit_s += t1 - t0
        if not batch:
            return []
        out = eng.execute(batch, any(self._running[s.seq_id].hidden for s, _ in batch), layer_hook=layer_hook)
        t2 = time.perf_counter()
        eng.finish(batch, out)
        done = []
        for i, (seq, tok) in enumerate(zip(out.seqs, out.next_tokens)):
            call = self._running.pop(seq.seq_id)
            eng.release(seq, "length")  # max_tokens=1: the request ends here, its full pages stay cached
            done.append((call, tok, out.logits[i] if call.logits else None,
                         out.hidden[i] if call.hidden and out.hidden is not None else None))
        t.kv_s += time.perf_counter() - t2
        t.forward_s += t2 - t1
        t.steps += 1
        t.batch_rows += len(batch)
        return done

    def stats(self) -> dict:
        kv = self.engine.kv_usage()
        t = self.times
        return {**asdict(t), "mean_batch": t.batch_rows / t.steps if t.steps else 0.0, "prefix_matches": kv.prefix_matches,
                "prefill_tokens": self.engine.stats.num_prefill_tokens, "decode_tokens": self.engine.stats.num_decode_tokens}

    def reset(self) -> int:
        """Between runs, idle only: flush the prefix cache and zero the phase times."""
        if not self.idle:
            raise RuntimeError(f"server {self.name!r} is busy: cannot reset while requests run")
        self.times = PhaseTimes()
        return self.engine.reset_prefix_cache()


def server_delta(before: dict, after: dict) -> dict:
    """One run's share of an `EngineServer.stats()` (counters are cumulative), with per-step means."""
    d = {k: after[k] - before[k] for k in after if k != "mean_batch"}
    steps, reqs = max(1, d["steps"]), max(1, d["requests"])
    d["mean_batch"] = d["batch_rows"] / steps
    d["busy_s"] = d["admit_s"] + d["forward_s"] + d["kv_s"]
    d["per_step_ms"] = {k: 1000 * d[f"{k}_s"] / steps for k in ("admit", "forward", "kv")}
    d["per_request_ms"] = {k: 1000 * d[f"{k}_s"] / reqs for k in ("served", "queue")}
    return d


@dataclass
class DispatchTimes:
    """The dispatcher's side, per model: calls and the time awaiting the server (the round trip)."""

    calls: dict[str, int] = field(default_factory=dict)
    wait_s: dict[str, float] = field(default_factory=dict)
    policy_s: float = 0.0  # route, send and receive


class TokenDispatcher:
    """Routes each token of each request between `servers` (index = model, order = the policy's
    model order, the first is the entry) with `policy`, one fresh server request per token."""

    def __init__(self, servers: Sequence[TokenServer], policy: Policy, entry: int = 0, eos_ids: tuple[int, ...] = ()):
        self.servers, self.policy, self.entry, self.eos_ids = list(servers), policy, entry, set(eos_ids)
        self.names = [s.name for s in self.servers]
        policy.bind(self.names)
        self.times = DispatchTimes({n: 0 for n in self.names}, {n: 0.0 for n in self.names})
        self._rids = itertools.count()

    async def stream(self, prompt: list[int], max_tokens: int, rid: str | None = None) -> AsyncIterator[tuple[int, str]]:
        """Yield (token, model that committed it) per output token: `max_tokens` of them, fewer on
        an EOS in `eos_ids` or a policy's finished PeerReq."""
        policy, tm, names = self.policy, self.times, self.names
        rid = rid if rid is not None else f"std-{next(self._rids)}"
        ids, n_prompt = list(prompt), len(prompt)
        seen, trace = [0] * len(self.servers), []
        state: list[dict] = [{} for _ in self.servers]
        at = self.entry
        want_logits, want_hidden = policy.reads_logits, policy.needs_hidden
        while len(ids) - n_prompt < max_tokens:
            t0 = time.perf_counter()
            reply = await self.servers[at].next_token(ids, want_logits, want_hidden)
            t1 = time.perf_counter()
            tm.calls[names[at]] += 1
            tm.wait_s[names[at]] += t1 - t0
            seen[at] = len(ids)  # the server was sent every committed token
            view = ReqView(rid, at, ids, n_prompt, reply.token, tuple(seen), tuple(trace), state[at])
            result = StepResult(at, reply.logits[None] if reply.logits is not None else NO_LOGITS,
                                torch.tensor([reply.token]), reply.hidden[None] if reply.hidden is not None else None,
                                [view])
            dest = policy.route(result)
            dest = int((dest.tolist() if hasattr(dest, "tolist") else list(dest))[0])
            target, pr = at, None
            if dest == STAY:
                new = [reply.token]
            else:
                peers = policy.peers(at)
                if not 1 <= dest <= len(peers):
                    raise ValueError(f"policy {policy.name!r} routed to peer {dest} from {names[at]!r}, "
                                     f"which has {len(peers)} peers")
                target = peers[dest - 1]
                pr = policy.send(view._replace(peer=target))
                unseen = ids[seen[target]:]
                if pr.loc != len(ids) or pr.tokens[:len(unseen)] != unseen:
                    raise ValueError(f"policy {policy.name!r}.send must carry the {len(unseen)} tokens "
                                     f"{names[target]!r} has not seen and loc {len(ids)}")
                new = pr.tokens[len(unseen):]
            tm.policy_s += time.perf_counter() - t1
            for tok in new:
                ids.append(tok)
                trace.append(at)
                if pr is None:  # as the runtime's stay: the model has seen its own committed token
                    seen[at] = len(ids)
                yield tok, names[at]
                if len(ids) - n_prompt >= max_tokens or tok in self.eos_ids:
                    return
            if pr is None:
                continue
            if pr.finished:
                return
            t2 = time.perf_counter()
            got = list(policy.receive(pr, ReqView(rid, target, ids, n_prompt, None, tuple(seen), tuple(trace),
                                                  state[target])))
            if got != ids[seen[target]:seen[target] + len(got)]:
                raise ValueError(f"policy {policy.name!r}.receive returned tokens that are not the committed "
                                 f"ones from position {seen[target]}")
            seen[target] += len(got)
            at = target
            tm.policy_s += time.perf_counter() - t2


class StdServing:
    """std-serving-inproc: an `EngineServer` per model in this process, with the router's thread plan
    and core sharing (a baseline gets every advantage the runtime takes), and a `TokenDispatcher`."""

    def __init__(self, models: Mapping[str, str | Path | dict | ModelSpec], policy: Policy,
                 kv_memory_gb: float = 4.0, page_size: int | None = None):
        self.specs = {n: ModelSpec.coerce(v) for n, v in models.items()}
        if page_size is not None:
            self.specs = {n: replace(s, engine_config=replace(s.engine_config, page_size=page_size))
                          for n, s in self.specs.items()}
        self.policy, self.kv_memory_gb = policy, kv_memory_gb
        self.servers: list[EngineServer] = []
        self.dispatcher: TokenDispatcher | None = None

    async def __aenter__(self) -> "StdServing":
        engines = [await asyncio.to_thread(s.build, "cpu", self.kv_memory_gb, len(self.specs))
                   for s in self.specs.values()]
        threads = plan_threads([e.num_params for e in engines])
        share = CoreShare.plan(engines, threads)
        for i, (name, eng, t) in enumerate(zip(self.specs, engines, threads)):
            self.servers.append(await EngineServer(name, eng, t).start(share, i))
        self.dispatcher = TokenDispatcher(self.servers, self.policy)
        return self

    async def __aexit__(self, *exc) -> None:
        for s in self.servers:
            await s.close()

    async def stream(self, prompt: list[int], max_tokens: int, out: list[int] | None = None) -> AsyncIterator[str]:
        """Yield the name of the model that committed each output token (the tokens go to `out`)."""
        async for tok, model in self.dispatcher.stream(prompt, max_tokens):
            if out is not None:
                out.append(tok)
            yield model

    def stats(self) -> dict:
        return {s.name: s.stats() for s in self.servers}
