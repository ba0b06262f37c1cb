"""The baselines aiorouter is measured against, built as well as their designs allow.

* `StdServing` -- the paper's "Std. Serving" (section 5.1): one independent single-model server
  per model, each with its own continuous batching and prefix cache (`EngineServer`: our own
  `engines.Engine` driven by its own asyncio task and worker thread), and an outside dispatcher
  that sends every routed token as a fresh one-token request (max_tokens=1) carrying the whole
  sequence so far. Each call pays admission, prefix matching and KV bookkeeping, as a single-model
  server must; nothing is slowed down on purpose.
* `HFNaive` -- what a researcher writes by hand (how the official R2R and CITER code works): two
  `transformers` models, one static batch of N requests, left-padded, decoded in lock-step with
  a `DynamicCache` per model; no continuous batching. Each step the small model decodes for the
  whole batch, routing is drawn per request, and the large model runs only when some request
  needs it, catching up over the tokens it missed in one multi-token forward for the batch.

Both route with the same rules as the runtime's policies (`RandomRule` = `policies.random`,
`RStitchRule` = `policies.rstitch`), with the same R2R token semantics: when the small model
hands a position to the large model, its own token is discarded and the large model generates
that position.
"""
from __future__ import annotations

import asyncio
import itertools
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import numpy as np
import torch

from aiorouter.cpu_threads import CoreShare, plan_threads
from engines import Engine, EngineConfig, SamplingParams
from engines.config import ModelConfig
from policies.rstitch import normalized_entropy

SMALL, LARGE = 0, 1
NAMES = ("small", "large")


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


def kv_tokens(path: str | Path, memory_gb: float, share: float, page_size: int = 16) -> int:
    """KV capacity the runtime gives a model with this share of `memory_gb` (Router._kv_tokens)."""
    per_tok = ModelConfig.from_dir(path).kv_bytes_per_token(torch.float32)
    return max(page_size * 64, int(memory_gb * share * 2**30 / per_tok))


# -- Std. Serving ----------------------------------------------------------------------------------
class EngineServer:
    """A single-model server: continuous batching and a prefix cache (`engines.Engine`), driven
    by its own asyncio task; forwards run on its own worker thread. Every `generate` call is a
    fresh request: admitted, prefix-matched against the cache, extended over the tokens the
    cache lacks, sampled once, finished (its full pages stay in the prefix cache)."""

    def __init__(self, name: str, path: str | Path, num_kv_tokens: int, engine_config: dict | None = None):
        self.name = name
        cfg = EngineConfig(**{**(engine_config or {}), "num_kv_tokens": num_kv_tokens})
        self.engine = Engine(path, config=cfg, load_tokenizer=False)
        self.executor: ThreadPoolExecutor | None = None  # made by set_threads once every server is loaded
        self.params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self._pending: list[tuple[list[int], asyncio.Future]] = []
        self._futs: dict[int, asyncio.Future] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.requests = 0
        self.steps = 0
        self.batch_rows = 0  # sum of batch sizes (mean batch = batch_rows / steps)
        self.busy_s = 0.0  # worker-thread time inside steps
        self._run_step = self._step

    def set_threads(self, threads: int) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"std-{self.name}", initializer=torch.set_num_threads,
                                           initargs=(threads,))

    async def start(self, share: CoreShare | None = None, index: int = 0) -> None:
        """`share`: the cores lent between the servers as in the router (its step counted as model `index`'s)."""
        if share is not None:
            self._run_step = share.step_fn(index, self._step)
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name=f"std-{self.name}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.executor.shutdown(wait=True, cancel_futures=True)

    async def generate(self, token_ids: list[int]) -> tuple[int, torch.Tensor]:
        """One fresh request for the next token of `token_ids`: -> (token, logits [vocab])."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((token_ids, fut))
        self._wake.set()
        return await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending and not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            pending, self._pending = self._pending, []
            try:
                results = await loop.run_in_executor(self.executor, self._run_step, pending)
            except Exception as e:  # fail every caller rather than hang them
                for fut in [f for _, f in pending] + list(self._futs.values()):
                    if not fut.done():
                        fut.set_exception(e)
                self._futs.clear()
                continue
            for fut, tok, logits in results:
                if not fut.done():
                    fut.set_result((tok, logits))

    def _step(self, pending: list[tuple[list[int], asyncio.Future]]) -> list:
        """On the worker thread (the event loop never touches the engine): admit the new
        requests, run one continuous-batching step, finish every request that got its token."""
        t0 = time.perf_counter()
        try:
            return self._admit_and_step(pending)
        finally:
            self.busy_s += time.perf_counter() - t0

    def _admit_and_step(self, pending) -> list:
        eng = self.engine
        for ids, fut in pending:
            seq = eng.add_request(ids, self.params)
            self._futs[seq.seq_id] = fut
        self.requests += len(pending)
        out = eng.forward()
        if out is None:
            return []
        self.steps += 1
        self.batch_rows += len(out.seqs)
        results = []
        for i, (seq, tok) in enumerate(zip(out.seqs, out.next_tokens)):
            eng.append_token(seq, tok)  # max_tokens=1: the request ends here
            results.append((self._futs.pop(seq.seq_id), tok, out.logits[i]))
        return results

    def stats(self) -> dict:
        return {"requests": self.requests, "steps": self.steps,
                "mean_batch": self.batch_rows / self.steps if self.steps else 0.0,
                "prefix_matches": self.engine.kv_usage().prefix_matches, "prefill_tokens": self.engine.stats.num_prefill_tokens,
                "decode_tokens": self.engine.stats.num_decode_tokens, "busy_s": self.busy_s}


class StdServing:
    """Two independent `EngineServer`s and an outside token-level dispatcher.

    Per output position the dispatcher asks the small server for the next token of the whole
    sequence so far; if the rule hands the position off, that token is discarded and the large
    server is asked for the same position instead (and, under rstitch, for the following ones
    until it is confident again)."""

    def __init__(self, small: str | Path, large: str | Path, rule, kv_memory_gb: float = 4.0,
                 engine_config: dict | None = None):
        self.paths = (Path(small), Path(large))
        self.rule, self.kv_memory_gb = rule, kv_memory_gb
        self.engine_config = engine_config or {}
        self.servers: list[EngineServer] = []
        self._rids = itertools.count()

    async def __aenter__(self) -> "StdServing":
        page = self.engine_config.get("page_size", 16)
        for name, path in zip(NAMES, self.paths):
            n_kv = kv_tokens(path, self.kv_memory_gb, 0.5, page)
            self.servers.append(await asyncio.to_thread(EngineServer, name, path, n_kv, self.engine_config))
        # the same per-model thread plan as the router's: a baseline gets every advantage we take
        threads = plan_threads([srv.engine.num_params for srv in self.servers])
        share = CoreShare.plan([srv.engine for srv in self.servers], threads)
        for i, (srv, t) in enumerate(zip(self.servers, threads)):
            srv.set_threads(t)
            await srv.start(share, i)
        return self

    async def __aexit__(self, *exc) -> None:
        for s in self.servers:
            await s.close()

    async def stream(self, prompt: list[int], max_tokens: int, out: list[int] | None = None) -> AsyncIterator[str]:
        """Yield the name of the model that made each output token (the tokens go to `out`)."""
        seq = list(prompt) if out is None else out
        if out is not None:
            out[:] = prompt
        state = self.rule.new_state(f"std-{next(self._rids)}")
        small, large = self.servers
        on_large = False
        for _ in range(max_tokens):
            if not on_large:
                tok, logits = await small.generate(seq)
                if not self.rule.small_hands_off([state], logits[None])[0]:
                    seq.append(tok)
                    yield NAMES[SMALL]
                    continue
                on_large = True  # small's token is discarded: the large model makes this position
            tok, logits = await large.generate(seq)
            seq.append(tok)
            yield NAMES[LARGE]
            if self.rule.large_hands_back([state], logits[None])[0]:
                on_large = False

    def stats(self) -> dict:
        return {s.name: s.stats() for s in self.servers}


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
