"""`Router`: the public API. Several models cooperate on each response; a policy may hand a
request to another model after any step. Request-centric programming, model-centric execution."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Mapping

from aiorouter import heap
from aiorouter.batching import parse_thresholds
from aiorouter.cpu_threads import CoreShare, resolve_threads
from aiorouter.metrics import RouterMetrics
from aiorouter.request import (GenerateResult, Kick, NewRequest, Release, ReqStatus, RouterError, RouterRequest,
                               StreamEvent, Wake)
from aiorouter.spec import ModelSpec
from aiorouter.subserver import Subserver
from engines import Engine, EngineConfig, SamplingParams
from engines.detokenizer import IncrementalDetokenizer
from engines.devices import parse_devices
from engines.stop import check_stop
from engines.streams import StreamFactory
from policies import Policy, make_policy

log = logging.getLogger("aiorouter")
MODES = ("delayed", "eager", "sync")

Prompt = str | list[int] | list[dict[str, str]]


class Router:
    def __init__(self, models: Mapping[str, str | Path | dict | ModelSpec], policy: str | Policy = "single",
                 policy_args: dict[str, Any] | None = None, entry: str | None = None, device: str = "cpu",
                 mode: str = "delayed", thresholds: object = "auto", max_concurrency: int = 64,
                 max_wait_ms: float | None = None, kv_memory_gb: float = 2.0, tune_concurrency: int | None = None,
                 threads: int | Mapping[str, int] | None = None):
        if not models:
            raise ValueError("a router needs at least one model")
        self.names = list(models)
        self.specs = [ModelSpec.coerce(v) for v in models.values()]
        self.entry = self.names.index(entry) if entry is not None and entry in self.names else 0
        if entry is not None and entry not in self.names:
            raise ValueError(f"unknown entry model {entry!r}; models: {', '.join(self.names)}")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
        self.mode, self.device, self.max_concurrency = mode, device, max_concurrency
        self.max_wait_s = max_wait_ms / 1000 if max_wait_ms else None
        self.kv_memory_gb = kv_memory_gb
        self.tune_concurrency = tune_concurrency
        resolve_threads(threads, self.names, [0] * len(self.names))  # bad input fails here, not at start()
        self._threads_spec = threads
        self.tuner = None  # the DTMC tuner behind thresholds="auto" (aiorouter.tuning)
        self._decisions = 0
        self._tuning_task: asyncio.Task | None = None
        self._closing = False
        self.policy = make_policy(policy, policy_args)
        self.policy.bind(self.names)
        self._threshold_spec = thresholds
        self._thresholds = parse_thresholds(thresholds, self.names, max_concurrency)
        self.subservers: list[Subserver] = []
        self.requests: dict[str, RouterRequest] = {}
        self.metrics = RouterMetrics(models={})
        self.tokenizer = None
        self.max_model_len = 0
        self._tasks: list[asyncio.Task] = []
        self._wakeup: asyncio.Event | None = None
        self._busy = 0  # subservers inside a step
        self._in_flight = 0  # NewRequest/Handoff messages posted and not yet handled
        self._started = False
        self._holds_heap = False
        self._core_share: CoreShare | None = None
        self.streams = StreamFactory()  # every model's CUDA streams are its own (engines/streams.py)

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> "Router":
        if self._started:
            return self
        self._closing = False
        self._wakeup = asyncio.Event()
        engines = []
        for name, spec in zip(self.names, self.specs):
            engines.append(await asyncio.to_thread(self._build_engine, name, spec))
        vocab = {n: e.model_config.vocab_size for n, e in zip(self.names, engines)}
        if len(set(vocab.values())) > 1:
            raise ValueError(f"all models must share one vocabulary; vocab sizes differ: {vocab}")
        self.tokenizer = engines[self.entry].tokenizer
        self.max_model_len = min(e.max_model_len for e in engines)
        threads = self._intra_op_threads(engines)
        for i, (name, eng) in enumerate(zip(self.names, engines)):
            s = Subserver(self, i, name, eng, threads[i])
            self.subservers.append(s)
            self.metrics.models[name] = s.metrics
        # every model on this CPU: the heaviest lends cores to the others' steps (cpu_threads.CoreShare)
        self._core_share = CoreShare.plan([getattr(e, "runner", None) for e in engines], threads)
        if self._thresholds is None:
            self._thresholds = await self._auto_thresholds()
        if self.mode == "sync":
            self._tasks = [asyncio.create_task(self._run_sync(), name="aiorouter-sync")]
        else:
            self._tasks = [asyncio.create_task(s.run(), name=f"aiorouter-{s.name}") for s in self.subservers]
        for t in self._tasks:
            t.add_done_callback(self._on_task_done)
        heap.hold()  # start-up objects out of the cyclic GC while this router serves (aiorouter.heap)
        self._holds_heap = True
        self._started = True
        return self

    def _intra_op_threads(self, engines: list[Engine]) -> list[int]:
        """Intra-op threads of each model's worker (CPU only; on GPU the worker just launches kernels)."""
        on_cpu = [all(d.type == "cpu" for d in parse_devices(s.device or self.device)) for s in self.specs]
        planned = resolve_threads(self._threads_spec, self.names, [e.num_params if c else 0 for e, c in zip(engines, on_cpu)])
        return [t if c else 1 for t, c in zip(planned, on_cpu)]

    def _build_engine(self, name: str, spec: ModelSpec) -> Engine:
        ecfg = spec.engine_config
        if spec.num_kv_tokens is None:
            share = spec.kv_share or 1.0 / len(self.specs)
            ecfg = EngineConfig(**{**ecfg.__dict__, "num_kv_tokens": self._kv_tokens(spec, share, ecfg)})
        elif spec.num_kv_tokens is not None:
            ecfg = EngineConfig(**{**ecfg.__dict__, "num_kv_tokens": spec.num_kv_tokens})
        if spec.engine == "sim":
            from engines.sim import SimEngine
            return SimEngine(spec.latency_ms / 1000, spec.latency_slope_ms / 1000, spec.vocab_size, ecfg, spec.token_seed)
        return Engine(spec.path, device=spec.device or self.device, dtype=spec.dtype, config=ecfg, streams=self.streams)

    def _kv_tokens(self, spec: ModelSpec, share: float, ecfg: EngineConfig) -> int:
        if spec.engine == "sim":
            return ecfg.num_kv_tokens
        from engines.config import ModelConfig
        from engines.engine import parse_dtype
        per_tok = ModelConfig.from_dir(spec.path).kv_bytes_per_token(parse_dtype(spec.dtype))
        return max(ecfg.page_size * 64, int(self.kv_memory_gb * share * 2**30 / per_tok))

    async def _auto_thresholds(self) -> dict[int, tuple[int, ...]]:
        """Profile every model, solve the throughput model for each concurrency, use B*."""
        ones = {n: (1,) * len(self.names) for n in range(1, self.max_concurrency + 1)}
        template = self.policy.routing_template()
        if self.mode != "delayed" or template is None or len(self.names) == 1:
            return ones
        from aiorouter.tuning import LatencyModel, fit_latency
        from engines.profile import profile_decode_latency
        cap = self.tune_concurrency or min(self.max_concurrency, 16 if len(self.names) == 2 else 8)
        sizes = sorted({1, 2, 4, cap})
        lats = []
        for s in self.subservers:
            # in the model's own worker: measured with the intra-op threads it will serve with
            lat = await asyncio.get_running_loop().run_in_executor(s.executor, profile_decode_latency, s.engine, sizes)
            fit = fit_latency(list(lat), list(lat.values()))
            if fit.c * cap < 0.05 * fit.a:  # a slope inside the noise only multiplies the chain's states
                fit = LatencyModel(fit(1), 0.0)
            lats.append(fit)
            log.info("model %s: decode step %s -> L(b) = %.2f ms + %.3f ms * b", s.name,
                     ", ".join(f"b={b}: {t * 1e3:.2f} ms" for b, t in lat.items()), fit.a * 1e3, fit.c * 1e3)
        # Solving takes seconds: serve with B = 1 meanwhile and switch when the table is ready.
        self._tuning_task = asyncio.get_running_loop().create_task(self._solve_initial(template, lats, cap))
        return ones

    def _start_tuner(self, template, lats: list, cap: int):
        """(thread) Pick delta from the state budget, then solve the table for N = 1..cap."""
        from aiorouter.tuning import Tuner, TunerConfig, choose_delta
        P, C = template
        # The quantum bounds the work: a fixed "40 quanta for the fastest step" let a slow model at
        # a large batch run to hundreds of quanta (minutes of solving); the budget does not.
        choice = choose_delta(P, lats, cap)
        log.log(logging.WARNING if choice.max_error > 0.05 else logging.INFO, "threshold tuning: %s%s",
                choice.describe(), "; the model is coarse for these latencies" if choice.max_error > 0.05 else "")
        cfg = TunerConfig.build(P, C, lats, cap, delta=choice.delta)
        return Tuner(cfg, should_stop=lambda: self._closing)

    async def _solve_initial(self, template, lats: list, cap: int) -> None:
        from aiorouter.tuning.online import TuningCancelled
        try:
            self.tuner = await asyncio.to_thread(self._start_tuner, template, lats, cap)
        except TuningCancelled:
            return
        except Exception as e:  # serving with B = 1 (eager) beats not serving
            log.exception("threshold tuning failed (%r); every threshold stays 1", e)
            return
        self._thresholds = {n: self.tuner.thresholds(min(n, cap)) for n in range(1, self.max_concurrency + 1)}
        log.info("delayed-batching thresholds: %s", ", ".join(
            f"N={n}: {dict(zip(self.names, self._thresholds[n]))}" for n in sorted({1, 2, 4, 8, cap}) if n <= cap))
        for s in self.subservers:
            s.post(Wake())

    async def wait_tuned(self) -> None:
        """Wait until the start-up threshold solve (thresholds="auto") is done."""
        if self._tuning_task is not None:
            await asyncio.shield(self._tuning_task)

    def observe_route(self, src: int, dst: int, tokens: int) -> None:
        """Feed the tuner's online estimate of P; re-solve off the loop when it drifts."""
        if self.tuner is None:
            return
        self.tuner.observe(src, dst, tokens)
        self._decisions += 1
        if self._decisions % 2000 == 0 and not getattr(self, "_resolving", False):
            self._resolving = True
            asyncio.get_running_loop().create_task(self._resolve())

    async def _resolve(self) -> None:
        try:
            if await asyncio.to_thread(self.tuner.maybe_resolve):
                cap = self.tuner.config.max_concurrency
                self._thresholds = {n: self.tuner.thresholds(min(n, cap)) for n in range(1, self.max_concurrency + 1)}
        except Exception as e:  # a failed re-solve keeps the current thresholds
            log.warning("threshold re-solve failed: %r", e)
        finally:
            self._resolving = False

    def _on_task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("subserver task %s died: %r", task.get_name(), task.exception())
            for req in list(self.requests.values()):
                self.fail(req, RouterError(f"router task {task.get_name()} died: {task.exception()!r}"))

    async def close(self) -> None:
        self._closing = True
        if self._tuning_task is not None:
            self._tuning_task.cancel()
        for req in list(self.requests.values()):
            self.abort(req)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self.subservers:
            s.drain()
            await asyncio.to_thread(s.close)
        self._tasks, self._started = [], False
        if self._holds_heap:
            heap.release()
            self._holds_heap = False

    stop = close

    async def __aenter__(self) -> "Router":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- scheduling state ----------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        return len(self.requests)

    def threshold(self, model: int) -> int:
        n = min(max(1, self.num_active), self.max_concurrency)
        return self._thresholds[n][model]

    def stalled(self) -> bool:
        """No model is stepping and no request is in transit: nothing changes unless someone launches."""
        return self._busy == 0 and self._in_flight == 0

    def kick(self) -> Subserver:
        """Break a stall: the model with the most ready requests launches. Returns it."""
        best = max(self.subservers, key=lambda s: (s.num_ready, -s.index))
        best.kicked = True
        best.post(Kick())  # wakes it if it is waiting on its inbox
        return best

    def policy_for(self, req: RouterRequest) -> Policy:
        return req.policy or self.policy

    async def _run_sync(self) -> None:
        """Step-sync: every model with work steps together and the round waits for the slowest."""
        while True:
            for s in self.subservers:
                s.drain()
            ready = [s for s in self.subservers if s.num_ready]
            if not ready:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await asyncio.gather(*(s.step() for s in ready))

    # -- token commits and request endings (called from subservers, on the event loop) -----------
    def commit(self, req: RouterRequest, tokens: list[int], model: int) -> None:
        name = self.names[model]
        for t in tokens:
            if req.finished:
                return
            req.token_ids.append(t)
            req.trace.append(model)
            self.metrics.models[name].tokens_committed += 1
            text = None
            if req.detok is not None:
                req.detok.add(t)
                text = req.detok.text
            reason, cut = check_stop(req.sampling, t, req.num_output_tokens, text, self._eos_ids(),
                                     len(req.token_ids), self.max_model_len)
            if cut is not None:
                req.stop_cut = cut
            if req.t_first_token is None:
                import time
                req.t_first_token = time.perf_counter()
            delta = self._take_text(req, final=reason is not None)
            req.events.put_nowait(StreamEvent(t, delta, name, req.num_output_tokens - 1, reason))
            if reason is not None:
                self._end(req, reason)

    def _eos_ids(self) -> tuple[int, ...]:
        return self.subservers[self.entry].engine.model_config.eos_token_ids

    def _take_text(self, req: RouterRequest, final: bool) -> str:
        """New text to stream; while a stop string could still be forming, hold its length back."""
        if req.detok is None:
            return ""
        if final:
            req.detok.flush()
        text = req.detok.text
        end = len(text)
        if req.stop_cut is not None:
            end = req.stop_cut
        elif req.sampling.stop and not final:
            end = max(req.emitted_chars, len(text) - max(len(s) for s in req.sampling.stop) + 1)
        delta = text[req.emitted_chars:end]
        req.emitted_chars = max(req.emitted_chars, end)
        return delta

    def _end(self, req: RouterRequest, reason: str) -> None:
        if req.finished:
            return
        req.status, req.finish_reason = ReqStatus.FINISHED, reason
        self.requests.pop(req.rid, None)
        self.metrics.active = len(self.requests)
        self.metrics.requests_finished[reason] += 1
        for i, s in enumerate(self.subservers):
            s.post(Release(req) if req.local[i] is not None else Wake())

    def fail(self, req: RouterRequest, err: BaseException) -> None:
        if req.finished:
            return
        req.error = err
        self.metrics.requests_failed += 1
        req.events.put_nowait(err)
        self._end(req, "error")

    def abort(self, req: RouterRequest) -> None:
        if not req.finished:
            self._end(req, "abort")

    # -- client API ----------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("the entry model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("the entry model's tokenizer has no chat template: pass text or token ids")
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            return list(ids if isinstance(ids, list) else ids["input_ids"])
        if isinstance(prompt, list):
            return list(prompt)
        raise ValueError(f"prompt must be text, token ids or chat messages, got {type(prompt).__name__}")

    def submit(self, prompt: Prompt, *, max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, min_p: float = 0.0, seed: int | None = None, stop: str | list[str] | None = None,
               ignore_eos: bool = False, policy: Policy | None = None) -> RouterRequest:
        """Validate and enqueue a request; read its events from `req.events`. Most users want `stream`."""
        if not self._started:
            raise RuntimeError("router is not started: use `async with Router(...)` or `await router.start()`")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, seed=seed, stop=tuple([stop] if isinstance(stop, str) else (stop or ())),
                                ignore_eos=ignore_eos)
        ids = self._prompt_ids(prompt)
        self.subservers[self.entry].engine.validate_prompt(ids)
        for s in self.subservers:
            if len(ids) >= s.engine.max_model_len:
                raise ValueError(f"prompt has {len(ids)} tokens; model {s.name!r} has context {s.engine.max_model_len}")
        if policy is not None:
            policy.bind(self.names)
        detok = IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer is not None else None
        req = RouterRequest(uuid.uuid4().hex, ids, len(ids), params, len(self.names), detok, policy=policy)
        self.requests[req.rid] = req
        self.metrics.requests_started += 1
        self.metrics.active = len(self.requests)
        for s in self.subservers:  # the active count changed: thresholds may change everywhere
            if s.index != self.entry:
                s.post(Wake())
        self.subservers[self.entry].post(NewRequest(req))
        return req

    async def stream(self, prompt: Prompt, **kwargs: Any) -> AsyncIterator[StreamEvent]:
        """Yield one event per committed token, in order, exactly once. Leaving the loop early
        (break, cancellation, a client disconnect) aborts the request on every model."""
        req = self.submit(prompt, **kwargs)
        async with contextlib.aclosing(self.events(req)) as events:
            async for ev in events:
                yield ev

    async def events(self, req: RouterRequest) -> AsyncIterator[StreamEvent]:
        """The events of a submitted request; closing this iterator early aborts the request."""
        try:
            while True:
                ev = await req.events.get()
                if isinstance(ev, BaseException):
                    raise ev
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            self.abort(req)

    async def generate(self, prompt: Prompt, **kwargs: Any) -> GenerateResult:
        req = self.submit(prompt, **kwargs)
        ids, models, text, reason = [], [], [], ""
        async with contextlib.aclosing(self.events(req)) as events:
            async for ev in events:
                if ev.token_id is not None:
                    ids.append(ev.token_id)
                    models.append(ev.model)
                text.append(ev.text)
                reason = ev.finish_reason or reason
        n_prompt = req.num_prompt_tokens
        usage = {"prompt_tokens": n_prompt, "completion_tokens": len(ids), "total_tokens": n_prompt + len(ids),
                 "per_model": {n: models.count(n) for n in self.names}}
        return GenerateResult("".join(text), ids, models, reason, usage)
