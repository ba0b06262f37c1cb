"""The baselines aiorouter is measured against, each built as well as its design allows.

* HF naive (`HFNaive`): what a researcher writes by hand, as the official R2R and CITER code runs:
  two `transformers` models, one static batch of N requests, left-padded, decoded in lock-step with
  a `DynamicCache` per model; no continuous batching. Each step the small model decodes for the
  whole batch, routing is drawn per request, and the large model runs only when some request
  needs it, catching up over the tokens it missed in one multi-token forward for the batch. It
  routes with the runtime's policies' rules (`RandomRule` = `policies.random`, `RStitchRule` =
  `policies.rstitch`) and R2R's token semantics: when the small model hands a position to the
  large model, its own token is discarded and the large model generates that position.
* Std. Serving, the paper's baseline (section 5.1): one standard single-model server per model and
  an outside dispatcher that routes every token between them. `EngineServer` is a single-model
  server: the project's `engines.Engine` (continuous batching, its own prefix cache) stepped by an
  asyncio task in its own worker thread; every call is a fresh request (`max_tokens=1`, the whole
  sequence so far): admitted, prefix-matched, extended over the tokens its cache lacks, sampled
  once and released (its full pages stay cached). It times each phase of its steps for the
  paper's Table 10 (`PhaseTimes`). `TokenDispatcher` asks, per token, the server of the model the
  request is on, applies the project's own `Policy` to the reply (route, then send and receive on
  a move; policies/base.py) as the runtime's subserver does after a step, and asks the chosen
  server next: any policy routes alike here and in aiorouter. `StdServing` holds both servers in
  this process (std-serving-inproc).
* std-serving-http: each `EngineServer` in its own process behind HTTP, as the paper runs one
  SGLang server per model (this module's main; `ServerProcesses` starts them), and the same
  dispatcher through `HttpTokenServer`, one keep-alive connection pool per server.

    python -m bench.baselines --name small --model sim:6.0 --port 8101 [--threads 1] [--page-size 16]
    python -m bench.baselines --name large --model /path/to/checkpoint --port 8102 --threads 2

The protocol is SGLang's native `/generate` with `input_ids`, minus what a per-token dispatcher does
not need (text, sampling options: greedy, one token). Ids travel as raw int32 rather than JSON:
encoding and parsing 8k ids as JSON costs about a millisecond a side, which would slow the baseline.

    POST /generate?logits=0|1&hidden=0|1   body: the whole sequence so far, int32 little-endian
      -> 200 application/octet-stream: the logits (float32 [vocab]) then the hidden state (float32
         [hidden]), each only when asked for; header X-Token: the sampled token
    GET /health · GET /info · GET /stats (phase times) · POST /reset (idle only: flush the prefix
    cache and zero the stats, between benchmark runs)
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import AsyncIterator, Mapping, NamedTuple, Protocol, Sequence

import numpy as np
import torch

from aiorouter import heap
from aiorouter.cpu_threads import CoreShare, plan_threads
from aiorouter.spec import ModelSpec
from bench.common import ROOT, closed_loop, free_port, wait_healthy
from engines import Engine, SamplingParams
from policies.base import STAY, Policy, ReqView, StepResult
from policies.rstitch import normalized_entropy

SMALL, LARGE = 0, 1


# -- routing rules (the policies' decisions, outside the runtime) ---------------------------------
class RandomRule:
    """`policies.random`: the small model hands a position to the large one with probability p
    (its token discarded); the large model commits its token and hands straight back.
    Seeded per request exactly like `RandomPolicy`."""

    name = "random"

    def __init__(self, p: float = 0.35, seed: int = 0):
        self.p, self.seed = float(p), int(seed)

    def describe(self) -> str:
        return f"random p={self.p}"

    def new_state(self, rid: str) -> dict:
        return {"rng": np.random.default_rng([self.seed, zlib.crc32(rid.encode())])}

    def small_hands_off(self, states: list[dict], logits: torch.Tensor | None) -> list[bool]:
        return [s["rng"].random() < self.p for s in states]

    def large_hands_back(self, states: list[dict], logits: torch.Tensor | None) -> list[bool]:
        return [True] * len(states)


class RStitchRule:
    """`policies.rstitch`: the small model hands off when its normalized entropy exceeds tau
    (token discarded); the large model keeps going while unsure and hands back on its first
    confident token, which it commits."""

    name = "rstitch"

    def __init__(self, tau: float = 0.03):
        self.tau = float(tau)

    def describe(self) -> str:
        return f"rstitch tau={self.tau}"

    def new_state(self, rid: str) -> dict:
        return {}

    def small_hands_off(self, states, logits):
        return (normalized_entropy(logits) > self.tau).tolist()

    def large_hands_back(self, states, logits):
        return (normalized_entropy(logits) <= self.tau).tolist()


def make_rule(policy: str, args: dict) -> RandomRule | RStitchRule:
    if policy == "random":
        return RandomRule(**args)
    if policy == "rstitch":
        return RStitchRule(**args)
    raise ValueError(f"the baselines implement the random and rstitch rules, not {policy!r}")


# -- HF naive ---------------------------------------------------------------------------------------
@dataclass
class BatchResult:
    t_first: float  # seconds from the batch's start to its first committed token
    seconds: float  # the whole batch
    traces: list[list[int]] = field(default_factory=list)  # per request: model of each output token
    tokens: list[list[int]] = field(default_factory=list)  # per request: output token ids
    large_forwards: int = 0
    small_forwards: int = 0
    small_tokens: int = 0  # token positions run through the small model (padding included)
    large_tokens: int = 0
    small_s: float = 0.0  # time in the small model's forwards (routing included)
    large_s: float = 0.0


class HFNaive:
    """Two `transformers` models decoding one static batch in lock-step (R2R/CITER official
    code style), routed per request; see the module docstring."""

    def __init__(self, small: str | Path, large: str | Path, rule, threads: int):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        self.rule, self.threads = rule, threads
        self.models = [AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32).eval() for p in (small, large)]
        self._rids = itertools.count()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int) -> BatchResult:
        from transformers import DynamicCache
        prev_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self._generate(prompts, max_tokens, DynamicCache)
        finally:
            torch.set_num_threads(prev_threads)

    def _generate(self, prompts, max_tokens, DynamicCache) -> BatchResult:
        t0 = time.perf_counter()
        B, P = len(prompts), max(map(len, prompts))
        T = P + max_tokens
        ids = torch.zeros(B, T, dtype=torch.long)
        mask = torch.ones(B, T, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, P - len(p):P] = torch.tensor(p, dtype=torch.long)
            mask[i, :P - len(p)] = 0
        padded = any(len(p) != P for p in prompts)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        caches = [DynamicCache(config=m.config) for m in self.models]
        seen = [0, 0]
        res = BatchResult(0.0, 0.0, [[] for _ in range(B)])

        def forward(m: int, L: int) -> torch.Tensor:
            """Catch model m up over the columns it has not seen (all rows alike: lock-step)
            and return its next-token logits for every row, [B, V]."""
            s = seen[m]
            if m == SMALL:
                res.small_tokens += B * (L - s)
            else:
                res.large_tokens += B * (L - s)
            out = self.models[m](input_ids=ids[:, s:L], attention_mask=mask[:, :L] if padded else None,
                                 position_ids=pos[:, s:L], cache=caches[m], use_cache=True, logits_to_keep=1)
            seen[m] = L
            return out.logits[:, -1, :].float()

        states = [self.rule.new_state(f"hf-{next(self._rids)}") for _ in range(B)]
        on_large = [False] * B
        L = P
        for step in range(max_tokens):
            nxt = [0] * B
            go = on_large[:]
            small_rows = [i for i in range(B) if not on_large[i]]
            t_s = time.perf_counter()
            if small_rows:
                logits = forward(SMALL, L)
                res.small_forwards += 1
                toks = logits.argmax(-1).tolist()
                idx = torch.tensor(small_rows)
                hand = self.rule.small_hands_off([states[i] for i in small_rows], logits[idx])
                for i, h in zip(small_rows, hand):
                    if h:
                        go[i] = True  # discard small's token: the large model makes this position
                    else:
                        nxt[i] = toks[i]
                        res.traces[i].append(SMALL)
            t_l = time.perf_counter()
            res.small_s += t_l - t_s
            large_rows = [i for i in range(B) if go[i]]
            if large_rows:
                logits = forward(LARGE, L)
                res.large_forwards += 1
                toks = logits.argmax(-1).tolist()
                idx = torch.tensor(large_rows)
                back = self.rule.large_hands_back([states[i] for i in large_rows], logits[idx])
                for i, b in zip(large_rows, back):
                    nxt[i] = toks[i]
                    res.traces[i].append(LARGE)
                    on_large[i] = not b
            res.large_s += time.perf_counter() - t_l
            ids[:, L] = torch.tensor(nxt, dtype=torch.long)
            L += 1
            if step == 0:
                res.t_first = time.perf_counter() - t0
        res.seconds = time.perf_counter() - t0
        res.tokens = ids[:, P:].tolist()
        return res

# -- Std. Serving ------------------------------------------------------------------------------------
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

    async def stats(self) -> dict:
        """Each server's counters, as a server process's /stats: no HTTP here, so no handler time."""
        return {s.name: {**s.stats(), "handler_s": 0.0} for s in self.servers}


async def std_loop(dispatcher: TokenDispatcher, stats, prompts: list, n: int, total: int, max_tokens: int,
                   warmup_prompts: list, warmup_tokens: int = 16) -> dict:
    """Std. Serving measured as bench.common.router_loop measures a router: `n` warm-up requests, then
    `n` closed-loop clients sending `total` of `prompts`. -> the loop's summary, each server's counters
    over the run (`stats`: async, -> {model: `EngineServer.stats()` and `handler_s`}) and Table 10's split."""
    async def send(p, max_tokens=max_tokens):
        async for _, model in dispatcher.stream(p, max_tokens):
            yield model

    await closed_loop(lambda p: send(p, min(warmup_tokens, max_tokens)), n, warmup_prompts, n)
    before, t0 = await stats(), _snapshot(dispatcher.times)
    with heap.frozen():  # what Router.start does, for the baselines that have no Router
        res = await closed_loop(send, n, prompts, total)
    after, t1 = await stats(), _snapshot(dispatcher.times)
    out = res.summary()
    servers = out["servers"] = {k: server_delta(before[k], after[k]) for k in after}
    out["busy"] = {k: v["busy_s"] / res.seconds for k, v in servers.items()}
    out["tokens_computed"] = {k: v["prefill_tokens"] + v["decode_tokens"] for k, v in servers.items()}
    out["step_ms"] = {k: 1000 * v["busy_s"] / max(1, v["steps"]) for k, v in servers.items()}
    out["mean_batch"] = {k: v["mean_batch"] for k, v in servers.items()}
    out["breakdown"] = breakdown(servers, {k: t1[k] - t0[k] for k in t0}, dispatcher.names)
    return out


def _snapshot(t) -> dict[str, float]:
    snap = {f"calls:{k}": v for k, v in t.calls.items()}
    snap.update({f"wait_s:{k}": v for k, v in t.wait_s.items()})
    snap["policy_s"] = t.policy_s
    return snap


def breakdown(servers: dict, disp: dict, names: list[str]) -> dict:
    """Table 10's split of a Std. Serving token, per model, in ms (per token = per request: each
    returns one). The round trip (the dispatcher's await) = HTTP outside the server's handler
    (client, loopback, framing) + the handler's own work (decode ids, encode the reply) + the queue
    (waiting for the step in flight) + the step it rides in + the loop's wake-up to reply. The step
    splits per step into admission and prefix matching, the forward, and the KV update."""
    out = {}
    calls_all = sum(disp[f"calls:{k}"] for k in names) or 1
    for k in names:
        s, calls, reqs = servers[k], max(1, disp[f"calls:{k}"]), max(1, servers[k]["requests"])
        step, req = s["per_step_ms"], s["per_request_ms"]
        rtt, handler = 1000 * disp[f"wait_s:{k}"] / calls, 1000 * s["handler_s"] / reqs  # handler: 0 in process
        step_ms = step["admit"] + step["forward"] + step["kv"]
        out[k] = {"requests": s["requests"], "steps": s["steps"], "mean_batch": s["mean_batch"],
                  "per_step_ms": {"admit_prefix_match": step["admit"], "forward": step["forward"], "kv_update": step["kv"]},
                  "per_token_ms": {"round_trip": rtt, "http_outside_server": rtt - handler if handler else 0.0,
                                   "server_http_handling": handler - req["served"] if handler else 0.0,
                                   "queue": req["queue"], "step": step_ms, "reply_wakeup": req["served"] - req["queue"] - step_ms,
                                   "policy": 1000 * disp["policy_s"] / calls_all}}
    return out

# -- std-serving-http: the server process ------------------------------------------------------------
@dataclass(frozen=True)
class ServerSpec:
    """How to start one model's server process. `model`: a checkpoint directory, or
    sim:LATENCY_MS[:SLOPE_MS] for a weightless `SimEngine` (the `aiorouter serve --model` syntax)."""

    name: str
    model: str
    threads: int = 1  # intra-op threads of the stepping worker (and OMP_NUM_THREADS of the process)
    page_size: int = 16
    num_kv_tokens: int | None = None  # None: the engine's default for a sim, kv_memory_gb for a checkpoint
    kv_memory_gb: float = 2.0
    max_model_len: int | None = None
    vocab_size: int = 512  # sim only

    def argv(self, port: int) -> list[str]:
        a = ["--name", self.name, "--model", self.model, "--port", str(port), "--threads", str(self.threads),
             "--page-size", str(self.page_size), "--kv-memory-gb", str(self.kv_memory_gb),
             "--vocab-size", str(self.vocab_size)]
        if self.num_kv_tokens is not None:
            a += ["--num-kv-tokens", str(self.num_kv_tokens)]
        if self.max_model_len is not None:
            a += ["--max-model-len", str(self.max_model_len)]
        return a


def build_engine(args: argparse.Namespace):
    from engines import EngineConfig
    from server.cli import parse_models
    spec = parse_models([f"{args.name}={args.model}"])[args.name]  # a ModelSpec: a path or sim:...
    ecfg = dict(page_size=args.page_size, max_model_len=args.max_model_len)
    if args.num_kv_tokens is not None:
        ecfg["num_kv_tokens"] = args.num_kv_tokens
    spec = replace(spec, engine_config=EngineConfig(**ecfg))
    if spec.engine == "sim":
        return replace(spec, vocab_size=args.vocab_size).build("cpu", args.kv_memory_gb, 1)
    # ids in, ids out: no tokenizer to load (transformers' import alone is seconds of start-up)
    return Engine(spec.path, config=replace(spec.engine_config, num_kv_tokens=spec.kv_tokens(args.kv_memory_gb, 1)),
                  load_tokenizer=False)


# -- the server process ------------------------------------------------------------------------------
class TokenApp:
    def __init__(self, server: EngineServer):
        self.server = server
        eng = server.engine
        self.vocab, self.max_len = eng.model_config.vocab_size, eng.max_model_len
        self.handler_s = 0.0  # summed over requests: the handler's time (the engine server's share included)

    def routes(self, app) -> None:
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/info", self.info)
        app.router.add_get("/stats", self.stats)
        app.router.add_post("/reset", self.reset)

    async def generate(self, request):
        from aiohttp import web
        t0 = time.perf_counter()
        body = await request.read()
        if not body or len(body) % 4:
            return web.json_response({"error": f"the body must be int32 token ids, got {len(body)} bytes"}, status=400)
        arr = np.frombuffer(body, dtype="<i4")
        if len(arr) >= self.max_len:
            return web.json_response({"error": f"{len(arr)} tokens; the context is {self.max_len}"}, status=400)
        if arr.min() < 0 or arr.max() >= self.vocab:
            return web.json_response({"error": f"token ids must be in [0, {self.vocab})"}, status=400)
        q = request.query
        r = await self.server.next_token(arr.tolist(), q.get("logits") == "1", q.get("hidden") == "1")
        parts = [t.float().numpy().tobytes() for t in (r.logits, r.hidden) if t is not None]
        self.handler_s += time.perf_counter() - t0
        return web.Response(body=b"".join(parts), content_type="application/octet-stream",
                            headers={"X-Token": str(r.token)})

    async def health(self, request):
        from aiohttp import web
        return web.json_response({"status": "ok"})

    async def info(self, request):
        from aiohttp import web
        eng = self.server.engine
        return web.json_response({"name": self.server.name, "vocab_size": self.vocab, "max_model_len": self.max_len,
                                  "hidden_size": eng.model_config.hidden_size, "page_size": eng.config.page_size,
                                  "pid": os.getpid()})

    async def stats(self, request):
        from aiohttp import web
        return web.json_response({**self.server.stats(), "handler_s": self.handler_s})

    async def reset(self, request):
        from aiohttp import web
        try:
            freed = self.server.reset()
        except RuntimeError as e:
            return web.json_response({"error": str(e)}, status=409)
        self.handler_s = 0.0
        return web.json_response({"pages_freed": freed})


async def serve(args: argparse.Namespace) -> None:
    from aiohttp import web
    engine = await asyncio.to_thread(build_engine, args)
    server = await EngineServer(args.name, engine, args.threads).start()
    app = web.Application(client_max_size=64 * 2**20)
    TokenApp(server).routes(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    heap.FrozenHeap.hold()  # as a router does once started: start-up objects out of the cyclic GC (aiorouter/heap.py)
    logging.getLogger("bench.baselines").info("%s ready on port %d", args.name, args.port)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True)
    ap.add_argument("--model", required=True, help="checkpoint directory, or sim:LATENCY_MS[:SLOPE_MS]")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-kv-tokens", type=int, default=None)
    ap.add_argument("--kv-memory-gb", type=float, default=2.0)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--vocab-size", type=int, default=512, help="sim models only")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from aiorouter import run
    try:
        run(serve(args))
    except KeyboardInterrupt:
        pass
    return 0


# -- the dispatcher's side -----------------------------------------------------------------------------
class HttpTokenServer:
    """A `TokenServer` over HTTP: one keep-alive connection pool to one server process."""

    def __init__(self, name: str, url: str):
        self.name, self.url = name, url
        self._session = None
        self.vocab_size = self.hidden_size = 0

    async def open(self) -> "HttpTokenServer":
        import aiohttp
        # no cap on connections: every in-flight token keeps its own, reused across tokens
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=600))
        info = await self.get("/info")
        self.vocab_size, self.hidden_size = info["vocab_size"], info["hidden_size"]
        return self

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def get(self, path: str) -> dict:
        async with self._session.get(self.url + path) as r:
            r.raise_for_status()
            return await r.json()

    async def reset(self) -> dict:
        async with self._session.post(self.url + "/reset") as r:
            data = await r.json()
            if r.status != 200:
                raise RuntimeError(f"{self.name}: reset refused: {data}")
            return data

    async def next_token(self, ids: list[int], logits: bool, hidden: bool) -> TokenReply:
        body = np.asarray(ids, dtype="<i4").tobytes()
        async with self._session.post(f"{self.url}/generate?logits={int(logits)}&hidden={int(hidden)}", data=body,
                                      headers={"Content-Type": "application/octet-stream"}) as r:
            payload = await r.read()
            if r.status != 200:
                raise RuntimeError(f"{self.name}: HTTP {r.status}: {payload[:300]!r}")
            token = int(r.headers["X-Token"])
        vec = torch.frombuffer(bytearray(payload), dtype=torch.float32) if payload else None
        lg = vec[:self.vocab_size] if logits else None
        hd = vec[self.vocab_size if logits else 0:] if hidden else None
        return TokenReply(token, lg, hd)


class ServerProcesses:
    """Start one server process per spec (concurrently), wait until each answers, stop them at exit."""

    def __init__(self, specs: list[ServerSpec], start_timeout_s: float = 600.0):
        self.specs, self.timeout = specs, start_timeout_s
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.clients: list[HttpTokenServer] = []

    async def __aenter__(self) -> "ServerProcesses":
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        try:
            for spec in self.specs:
                port = free_port()
                log = Path(tempfile.mkstemp(prefix=f"token-server-{spec.name}-", suffix=".log")[1])
                self.logs.append(log)
                with open(log, "w") as f:
                    self.procs.append(subprocess.Popen(
                        [sys.executable, "-m", "bench.baselines", *spec.argv(port)], cwd=ROOT, stdout=f,
                        stderr=subprocess.STDOUT, env={**env, "OMP_NUM_THREADS": str(spec.threads)}))
                self.clients.append(HttpTokenServer(spec.name, f"http://127.0.0.1:{port}"))
            await asyncio.gather(*(wait_healthy(c.url, self.timeout, 0.2, proc, log)
                                   for c, proc, log in zip(self.clients, self.procs, self.logs)))
            for c in self.clients:
                await c.open()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        for c in self.clients:
            await c.close()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                await asyncio.to_thread(p.wait, 30)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in self.logs:
            log.unlink(missing_ok=True)

    async def stats(self) -> dict[str, dict]:
        return {c.name: await c.get("/stats") for c in self.clients}

    async def reset(self) -> None:
        for c in self.clients:
            await c.reset()


if __name__ == "__main__":
    raise SystemExit(main())
