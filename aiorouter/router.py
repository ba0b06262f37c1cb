"""`Router`: the public API and the lifecycle. Several models cooperate on each response; a policy
may hand a request to another model after any step. Request-centric programming, model-centric
execution.

Who owns what: `RouterConfig` says how to serve; `ModelSpec.build` makes each engine and sizes its
KV; `LaunchControl` decides when each model launches; a `Subserver` per model runs its steps
(`Engine.step_async`) and its `Routing` applies the policy; each engine commits the tokens its
model keeps (`Engine.commit`); the `RequestTable` streams every committed token and ends requests;
`TuningService` picks the delayed-batching thresholds. The router wires them at `start` and
answers clients; it changes no engine it is handed (what it needs per step, it passes per step).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Mapping

import jinja2

from aiorouter import heap
from aiorouter.cpu_threads import CoreShare, resolve_threads
from aiorouter.config import RouterConfig
from aiorouter.launch import MODES, LaunchControl, parse_thresholds
from aiorouter.metrics import RouterMetrics
from aiorouter.request import GenerateResult, NewRequest, RouterError, RouterRequest, RouterUnavailable, StreamEvent
from aiorouter import scoring
from aiorouter.requests import RequestTable
from aiorouter.scoring import ScoreResult
from aiorouter.spec import ModelSpec
from aiorouter.subserver import Subserver
from engines import Engine, SamplingParams
from engines.engine import KVUsage
from engines.grammar import StructuredOutput
from engines.logprobs import requested
from engines.runner import ForwardOutput
from engines.streams import StreamFactory
from policies import ModelInfo, Policy, make_policy

log = logging.getLogger("aiorouter")

# The one prompt convention (as vLLM's LLM.generate and the OpenAI endpoints): a string is raw
# completion text, tokenized as is; a list of {"role", "content"} messages is chat, rendered with
# the entry model's chat template; a list of ints is token ids. `aiorouter generate` sends its text
# as one user message, /v1/completions a string, /v1/chat/completions messages.
Prompt = str | list[int] | list[dict[str, str]]

# A subserver that dies more than `max_restarts` times within this window is not restarted again.
RESTART_WINDOW_S = 600.0


class Router:
    def __init__(self, models: Mapping[str, str | Path | dict | ModelSpec | Engine],
                 config: RouterConfig = RouterConfig()):
        """`models`: name -> a model (ModelSpec, or what `ModelSpec.coerce` reads), or an Engine,
        served as given and left as it was (built in memory, or shared between routers one after
        another). `config`: how to serve them (RouterConfig)."""
        if not isinstance(config, RouterConfig):
            raise TypeError(f"config must be a RouterConfig, got {type(config).__name__}")
        if not models:
            raise ValueError("a router needs at least one model")
        self.config = config
        self.names = list(models)
        self.specs = [v if isinstance(v, Engine) else ModelSpec.coerce(v) for v in models.values()]
        if config.entry is not None and config.entry not in self.names:
            raise ValueError(f"unknown entry model {config.entry!r}; models: {', '.join(self.names)}")
        self.entry = self.names.index(config.entry) if config.entry is not None else 0
        self.mode, self.device, self.max_concurrency = config.mode, config.device, config.max_concurrency
        resolve_threads(config.threads, self.names, [0] * len(self.names))  # bad input fails here, not at start()
        policy = make_policy(config.policy, config.policy_args)
        policy.bind(self.names)
        # under a fault plan (tests only) the router calls the policy through it: built here, once
        self.policy = config.faults.wrap_policy(policy) if config.faults is not None else policy
        self._fixed_thresholds = parse_thresholds(config.thresholds, self.names, config.max_concurrency)
        self.metrics = RouterMetrics(models={})
        self.subservers: list[Subserver] = []
        self.tokenizer = None
        self.max_model_len = 0
        self.tuning = None  # aiorouter.tuning.TuningService behind thresholds="auto" in delayed mode
        self._launch: LaunchControl | None = None
        self._requests: RequestTable | None = None
        self._tasks: list[asyncio.Task] = []
        self._eos_ids: tuple[int, ...] = ()
        self._heap: heap.FrozenHeap | None = None
        self._core_share: CoreShare | None = None
        self.streams = StreamFactory()  # every model's CUDA streams are its own (engines/streams.py)
        self._models: list[ModelInfo] = []  # what each model is, for the policy's setup
        self._extra_rows: list[int] = []  # per model: output rows past the shared vocabulary
        self._down: dict[str, str] = {}  # model -> why its subserver is not serving now
        self._restarts: list[float] = []  # when each restart within RESTART_WINDOW_S happened
        self._restarting: set[asyncio.Task] = set()
        self._closing = False
        self.dead: str | None = None  # why this router serves no more (a subserver past max_restarts)
        self._dead_event: asyncio.Event | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> "Router":
        if self._tasks:
            return self
        engines = []
        for name, s in zip(self.names, self.specs):
            if not isinstance(s, Engine):
                log.info("loading model %s: %s", name, s.path if s.engine == "real" else "simulated")
            engines.append(s if isinstance(s, Engine) else
                           await asyncio.to_thread(s.build, self.device, self.config.kv_memory_gb, len(self.specs),
                                                   self.streams))
        self._models = [ModelInfo(n, str(e.path) if e.path is not None else None, e.model_config.vocab_size,
                                  e.model_config.hidden_size, str(e.devices[-1])) for n, e in zip(self.names, engines)]
        self.policy.setup(self._models)
        self._extra_rows = [e.check_reserved_rows(x) for e, x in zip(engines, self._vocabulary_check(self.policy))]
        self.tokenizer = engines[self.entry].tokenizer
        self._eos_ids = engines[self.entry].model_config.eos_token_ids
        self.max_model_len = min(e.max_model_len for e in engines)
        self._launch = LaunchControl(self.mode, len(engines), self.max_concurrency, self._fixed_thresholds,
                                     self.config.max_wait_s)
        self._requests = RequestTable(self.names, self.metrics, self._launch)
        threads = self._intra_op_threads(engines)
        # every model on this CPU: the heaviest lends cores to the others' steps (cpu_threads.CoreShare)
        self._core_share = CoreShare.plan(engines, threads)
        self.tuning = self._make_tuning()
        observe = self.tuning.observe if self.tuning is not None else None
        observe_step = self.tuning.observe_step if self.tuning is not None else None
        self.subservers = [Subserver(i, n, e, self._launch, self._requests, t, self._step_fn(i, e), x,
                                     observe, observe_step)
                           for i, (n, e, t, x) in enumerate(zip(self.names, engines, threads, self._extra_rows))]
        self.metrics.models.update({s.name: s.metrics for s in self.subservers})
        if self.tuning is not None:
            from engines.profile import profile_dispatched_latency
            # timed from the loop: the hop to the worker and back is part of every step the chain models
            await self.tuning.start([lambda sizes, s=s: profile_dispatched_latency(s.engine, s.worker, sizes)
                                     for s in self.subservers], lambda cap: self._profile_contention(cap, threads))
        self._dead_event, self.dead, self._down, self._restarts = asyncio.Event(), None, {}, []
        self._tasks = [self._run_subserver(s) for s in self.subservers]
        self._heap = heap.FrozenHeap.hold()  # start-up objects out of the cyclic GC while this router serves
        return self

    def _step_fn(self, index: int, engine: Engine) -> Callable[..., ForwardOutput]:
        """Model `index`'s step function, as its worker calls it: the engine's forward with this
        router's reserved output rows, under the fault plan when there is one (tests only), and
        counted or hooked by the core share on a shared CPU. Everything is passed per step: the
        engine is left as it was handed."""
        step = functools.partial(engine.execute, reserved_rows=self._extra_rows[index])
        if self.config.faults is not None:
            if index == 0:
                log.warning("fault injection is on (test-only): prompts that start with a marker fail on purpose")
            step = self.config.faults.wrap_step(step)
        return self._core_share.step_fn(index, step) if self._core_share is not None else step

    def _vocabulary_check(self, policy: Policy) -> list[int]:
        """-> per model, the output rows past the shared vocabulary that `policy` reads (never sampled)."""
        extra = [int(policy.extra_rows(i)) for i in range(len(self._models))]
        rows = {m.name: m.vocab_size for m in self._models}
        if len({m.vocab_size - x for m, x in zip(self._models, extra)}) > 1:
            why = f", less the rows policy {policy.name!r} reads past it: {extra}" if any(extra) else ""
            if not any(extra) and max(rows.values()) == min(rows.values()) + 1:
                why = (" (a Co-LLM small model, whose extra output row is its deferral head, is served as is "
                       "with policy='colm')")
            raise ValueError(f"all models must share one vocabulary; vocab sizes differ: {rows}{why}")
        return extra

    @staticmethod
    def _query_text(prompt: Prompt, ids: list[int], tokenizer) -> str | None:
        """The text a query-level scorer reads: RouteLLM reads a chat's last message."""
        if isinstance(prompt, str):
            return prompt
        if prompt and isinstance(prompt[0], dict):
            return str(prompt[-1].get("content", ""))
        return tokenizer.decode(ids) if tokenizer is not None else None

    def _make_tuning(self):
        template = self.policy.routing_template()
        if self._fixed_thresholds is not None or self.mode != "delayed" or template is None or len(self.names) == 1:
            return None
        from aiorouter.tuning.service import RESOLVE_EVERY, TuningService
        return TuningService(self.names, template, self.max_concurrency, self.config.tune_concurrency,
                             self._launch.set_schedule, RESOLVE_EVERY if self.config.retune else None)

    async def _profile_contention(self, cap: int, threads: list[int]) -> list:
        """How much the models slow each other (engines.profile.profile_contention), measured in
        their own workers with the core lending they serve with, before serving starts; cached
        by checkpoint files and device under $AIOROUTER_CACHE/contention. Sim engines: none."""
        from engines.default_model import cache_dir
        from engines.profile import contention_pairs, profile_contention
        engines = [s.engine for s in self.subservers]
        heavy = max(range(len(engines)), key=lambda i: (engines[i].num_params, -i))
        share = self._core_share
        return await asyncio.to_thread(profile_contention, engines, contention_pairs(len(engines), cap, heavy),
                                       threads=threads, executors=[s.worker for s in self.subservers],
                                       wrap=share.step_fn if share is not None else None,
                                       cache_dir=cache_dir() / "contention")

    def _intra_op_threads(self, engines) -> list[int]:
        """Intra-op threads of each model's worker (CPU only; on GPU the worker just launches kernels)."""
        on_cpu = [all(d.type == "cpu" for d in e.devices) for e in engines]
        planned = resolve_threads(self.config.threads, self.names,
                                  [e.num_params if c else 0 for e, c in zip(engines, on_cpu)])
        return [t if c else 1 for t, c in zip(planned, on_cpu)]

    def _run_subserver(self, s: Subserver) -> asyncio.Task:
        task = asyncio.create_task(s.run(), name=f"aiorouter-{s.name}")
        task.add_done_callback(lambda t, i=s.index: self._on_task_done(i, t))
        return task

    def _on_task_done(self, index: int, task: asyncio.Task) -> None:
        """A subserver's loop never ends on a request's failure (those fail the request alone), so
        an ending that is not `close` is a bug: every request fails now, with the reason, rather
        than wait on a model that will never step; then the model restarts, or the router is dead."""
        if self._closing or task.cancelled():
            return
        name, err = self.names[index], task.exception()
        why = f"the subserver of model {name!r} died: {err!r}"
        log.error("%s; failing every request in flight", why, exc_info=err)
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S]
        if len(self._restarts) >= self.config.max_restarts:
            self.dead = self._down[name] = (
                f"{why}; it has been restarted {len(self._restarts)} times in the last {RESTART_WINDOW_S:.0f} s "
                f"(max_restarts={self.config.max_restarts}), so it stays down")
        else:
            delay = self.config.restart_delay_s * 2 ** len(self._restarts)
            self._restarts.append(now)
            self._down[name] = f"{why}; restarting it in {delay:.1f} s"
            restart = asyncio.get_running_loop().create_task(self._restart(index, delay),
                                                             name=f"aiorouter-restart-{name}")
            self._restarting.add(restart)
            restart.add_done_callback(self._restarting.discard)
        self._requests.fail_all(RouterUnavailable(f"{self._down[name]}; every request in flight failed"))
        if self.dead:
            log.error("router is dead: %s", self.dead)
            self._dead_event.set()

    async def _restart(self, index: int, delay: float) -> None:
        await asyncio.sleep(delay)
        s = self.subservers[index]
        s.reset()  # on the loop: nothing steps on this model meanwhile, its task is over
        self._tasks[index] = self._run_subserver(s)
        del self._down[s.name]
        self.metrics.subserver_restarts[s.name] += 1
        log.warning("model %s: subserver restarted with a fresh engine state (KV pool, prefix cache, scheduler)",
                    s.name)

    def health(self) -> dict[str, str]:
        """Models whose subserver is not serving now -> why (restarting, or down for good when
        `dead`); empty while every model serves."""
        return dict(self._down)

    async def wait_dead(self) -> str:
        """Wait until this router cannot serve any more (see `max_restarts`) -> why."""
        if self._dead_event is None:
            raise RuntimeError("router is not started: use `async with Router(...)` or `await router.start()`")
        await self._dead_event.wait()
        return self.dead

    @property
    def tuned(self) -> bool:
        """The start-up threshold solve is over (or there is none): the router runs as configured."""
        return self.tuning is None or self.tuning.solved

    async def wait_tuned(self) -> None:
        """Wait until the start-up threshold solve (thresholds="auto") is done."""
        if self.tuning is not None:
            await self.tuning.wait()

    async def close(self) -> None:
        self._closing = True
        for r in list(self._restarting):
            r.cancel()
        await asyncio.gather(*self._restarting, return_exceptions=True)
        if self.tuning is not None:
            await self.tuning.close()
        if self._requests is not None:
            for req in list(self._requests.active.values()):
                self._requests.abort(req)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self.subservers:
            s.drain()  # the releases the aborts posted: every KV page back
            await asyncio.to_thread(s.close)
        self._core_share = None
        self._tasks = []
        self._closing = False
        if self._heap is not None:
            self._heap.release()
            self._heap = None

    stop = close

    async def __aenter__(self) -> "Router":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- state for callers ---------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return bool(self._tasks)

    @property
    def core_share(self) -> CoreShare | None:
        """How the models on this CPU lend each other cores while serving (None: they do not)."""
        return self._core_share

    @property
    def num_active(self) -> int:
        return len(self._requests) if self._requests is not None else 0

    def thresholds(self, n: int) -> dict[str, int]:
        """The delayed-batching threshold of each model at concurrency n (B = 1 until tuning is done)."""
        return dict(zip(self.names, self._launch.thresholds_at(n)))

    def schedule(self, n: int) -> str:
        """The schedule run at concurrency n: the router's mode, or in `delayed` mode with tuned
        thresholds the one the throughput model predicts best there ("delayed", "eager" or "sync")."""
        return self._launch.mode_at(n)

    def set_schedule(self, schedule: str, thresholds: Mapping[str, int] | None = None) -> None:
        """Run `schedule` ("delayed" with `thresholds`, "eager" or "sync") at every concurrency from
        now on, while serving: requests in flight carry on under it, as they do when the tuner swaps
        a schedule. For a caller that picks the schedule itself, and for A/B measurements of the
        schedules on one warm router and one stationary load (bench.modes). Needs a
        delayed-mode router with fixed thresholds: a tuned one's tuner would overwrite it."""
        if not self._tasks:
            raise RuntimeError("router is not started: use `async with Router(...)` or `await router.start()`")
        if self.mode != "delayed" or self.tuning is not None:
            raise ValueError("set_schedule needs Router(mode='delayed', thresholds={...}): "
                             f"this router runs mode {self.mode!r} with thresholds "
                             f"{'auto (its tuner owns the schedule)' if self.tuning is not None else 'fixed'}")
        if schedule not in MODES:
            raise ValueError(f"unknown schedule {schedule!r}; use one of {', '.join(MODES)}")
        if schedule == "delayed" and not thresholds:
            raise ValueError("a delayed schedule needs thresholds, a dict model -> B")
        table = parse_thresholds(dict(thresholds) if schedule == "delayed" else dict.fromkeys(self.names, 1),
                                 self.names, self.max_concurrency)
        self._launch.set_schedule(table, {n: schedule for n in table})

    def dead_tasks(self) -> list[str]:
        """Names of subserver tasks that have stopped (a healthy running router has none)."""
        return [t.get_name() for t in self._tasks if t.done()]

    @property
    def num_tasks(self) -> int:
        """Subserver tasks running (one per model while the router serves)."""
        return sum(not t.done() for t in self._tasks)

    def kv_usage(self) -> dict[str, KVUsage]:
        """Each model's KV pool now: pages in use by requests, cached by the prefix cache, free."""
        return {s.name: s.engine.kv_usage() for s in self.subservers}

    def reset_prefix_cache(self) -> dict[str, int]:
        """Empty every model's prefix cache of the pages no request holds -> pages freed per model.
        A cache that is never flushed keeps its pages until the pool needs them (they are evictable,
        never leaked); this gives them back now: to measure what is left, or after a weight change."""
        return {s.name: s.engine.reset_prefix_cache() for s in self.subservers}

    # -- client API ----------------------------------------------------------------------------
    def prompt_ids(self, prompt: Prompt, *, add_generation_prompt: bool = True,
                   add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of a prompt (see `Prompt`): text is tokenized as is (with the tokenizer's BOS
        where it adds one), with no chat template (a chat
        model given a bare question may answer nothing: pass messages), chat messages go through the
        entry model's chat template, token ids pass through. The switches are vLLM's /tokenize
        options; their defaults are what generation does (None: special tokens for text, none
        added to a rendered chat)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("the entry model has no tokenizer: pass token ids")
            # the tokenizer's own special tokens, as vLLM's completions do: a BOS where the model
            # expects one (Gemma, Llama; a Gemma prompt without it answers nonsense), none for Qwen/SmolLM2
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens is not False)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("the entry model's tokenizer has no chat template: pass text or token ids")
            try:
                if add_special_tokens:  # rendered, then tokenized with the tokenizer's specials
                    text = self.tokenizer.apply_chat_template(prompt, tokenize=False,
                                                              add_generation_prompt=add_generation_prompt)
                    return list(self.tokenizer.encode(text, add_special_tokens=True))
                ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=add_generation_prompt)
            except (jinja2.TemplateError, TypeError, KeyError) as e:  # the template read the messages and said no
                raise ValueError(f"the entry model's chat template cannot render these messages: "
                                 f"{type(e).__name__}: {e}") from None
            return list(ids if isinstance(ids, list) else ids["input_ids"])
        if isinstance(prompt, list):
            return list(prompt)
        raise ValueError(f"prompt must be text, token ids or chat messages, got {type(prompt).__name__}")

    def submit(self, prompt: Prompt, *, max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, min_p: float = 0.0, seed: int | None = None, stop: str | list[str] | None = None,
               ignore_eos: bool = False, logprobs: bool = False, top_logprobs: int = 0,
               repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
               logit_bias: Mapping[int, float] | None = None, stop_token_ids: list[int] | None = None,
               min_tokens: int = 0, skip_special_tokens: bool = True, include_stop_str_in_output: bool = False,
               structured: StructuredOutput | Mapping[str, Any] | None = None,
               policy: Policy | None = None) -> RouterRequest:
        """Validate and enqueue a request; read its events with `events`. Most users want `stream`.
        Decoding is greedy unless told otherwise (a library call should be reproducible); the HTTP
        server fills omitted fields from the model's generation_config.json instead, as vLLM does.
        `logprobs`: each event carries its token's log probability under the model that wrote it
        (raw logits, before temperature), with the `top_logprobs` (at most 20) most probable tokens.
        The sampling controls (penalties, `logit_bias`, `stop_token_ids`, `min_tokens`, the text
        options) are vLLM's (engines.sampling.SamplingParams): whichever model samples applies them,
        and the penalties count the response's tokens whichever model wrote them.
        `structured`: the response follows a JSON schema, any JSON object, a regex, one of a list of
        strings or an EBNF grammar, given as vLLM's `structured_outputs` ({"json": schema},
        {"json_object": True}, {"regex": ...}, {"choice": [...]}, {"grammar": ...}) or an
        `engines.grammar.StructuredOutput`. The grammar's state is the request's: it advances with
        every committed token, whichever model wrote it, and each model masks its logits with it when
        it samples. The response ends ("stop") once the grammar is complete and allows nothing more;
        a token a policy's send commits that the grammar refuses fails the request. A grammar is
        compiled once per distinct schema (cached); `await compile_structured(...)` first compiles
        it off the event loop (the server does)."""
        self._require_serving()
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                min_p=min_p, seed=seed, stop=tuple([stop] if isinstance(stop, str) else (stop or ())),
                                ignore_eos=ignore_eos, logprobs=requested(logprobs, top_logprobs),
                                repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, logit_bias=logit_bias or (),
                                stop_token_ids=tuple(stop_token_ids or ()), min_tokens=min_tokens,
                                skip_special_tokens=skip_special_tokens,
                                include_stop_str_in_output=include_stop_str_in_output,
                                structured=self._structured(structured))
        ids = self.prompt_ids(prompt)
        self.check_prompt(ids)
        self.subservers[self.entry].engine.validate_sampling(params, self._extra_rows[self.entry])
        pol = self._request_policy(policy)
        grammar = self.subservers[self.entry].engine.grammars.state(params.structured) if params.structured else None
        req = self._requests.new(ids, params, pol, self.tokenizer, self._eos_ids, self.max_model_len, grammar)
        self._launch.post(self._admit(pol, req, prompt, ids), NewRequest(req))
        return req

    def _require_serving(self) -> None:
        """RuntimeError before `start`; RouterUnavailable while a model is down (retry shortly)."""
        if not self._tasks:
            raise RuntimeError("router is not started: use `async with Router(...)` or `await router.start()`")
        if self._down:
            raise RouterUnavailable(self.dead or "; ".join(self._down.values()))

    def check_prompt(self, ids: list[int]) -> None:
        """ValueError unless every model can take prompt `ids`: token ids of the vocabulary, and
        shorter than each model's context (a generated token must fit)."""
        self.subservers[self.entry].engine.validate_prompt(ids, self._extra_rows[self.entry])
        for s in self.subservers:
            if len(ids) >= s.engine.max_model_len:
                raise ValueError(f"prompt has {len(ids)} tokens; model {s.name!r} has context {s.engine.max_model_len}")

    def _request_policy(self, policy: Policy | None) -> Policy:
        """The policy a request runs under: the router's, or its own bound and set up here."""
        if policy is None:
            return self.policy
        policy.bind(self.names)
        policy.setup(self._models)
        if self._vocabulary_check(policy) != self._extra_rows:
            raise ValueError(f"policy {policy.name!r} reads other output rows than the router's "
                             f"policy {self.policy.name!r}: it cannot route this router's requests")
        if self.config.faults is not None:  # tests only: this request's policy meets the plan too
            policy = self.config.faults.wrap_policy(policy)
        return policy

    @staticmethod
    def _structured(spec: StructuredOutput | Mapping[str, Any] | None) -> StructuredOutput | None:
        if spec is None or isinstance(spec, StructuredOutput):
            return spec
        return StructuredOutput.from_mapping(spec, "structured")

    async def compile_structured(self, spec: StructuredOutput | Mapping[str, Any]) -> None:
        """Compile `spec`'s grammar in a thread, so the `submit` that follows finds it in the
        compiler's cache and the event loop never waits on a compile (the first one also builds the
        tokenizer's grammar tables, about 0.1 s for a 49k vocabulary). ValueError for a bad one."""
        so = self._structured(spec)
        if so is not None:
            engine = self.subservers[self.entry].engine
            await asyncio.to_thread(lambda: engine.grammars.compile(so))

    def _admit(self, policy: Policy, req: RouterRequest, prompt: Prompt, ids: list[int]) -> int:
        """The model the request starts on (Policy.admit). Bad input (a ValueError) is the caller's
        and is raised; any other failure of the policy fails this request only."""
        try:
            # the text is only built for a policy that admits (decoding token ids costs per request)
            text = self._query_text(prompt, ids, self.tokenizer) if policy.admits else None
            start = policy.admit(req.rid, ids, text)
            start = self.entry if start is None else int(start)
            if not 0 <= start < len(self.names):
                raise RouterError(f"policy {policy.name!r}.admit chose model {start}; the router has "
                                  f"{len(self.names)} models")
        except ValueError:
            self._requests.abort(req)
            raise
        except Exception as e:
            self._requests.fail(req, e if isinstance(e, RouterError) else
                                RouterError(f"policy {policy.name!r} raised in admit: {e!r}"))
            return self.entry  # the failed request is over; its events say why
        return start

    async def stream(self, prompt: Prompt, **kwargs: Any) -> AsyncIterator[StreamEvent]:
        """Yield one event per committed token, in order, exactly once. `prompt` follows `Prompt`
        (a string is raw text, messages are chat); `kwargs` are `submit`'s (greedy by default).
        Leaving the loop early (break, cancellation, a client disconnect) aborts the request on
        every model."""
        req = self.submit(prompt, **kwargs)
        async with contextlib.aclosing(self.events(req)) as events:
            async for ev in events:
                yield ev

    def abort(self, req: RouterRequest) -> None:
        """End a submitted request on every model (a no-op once it has ended): for a caller that
        submitted it and will not read its events (`events` aborts it when closed early)."""
        self._requests.abort(req)

    async def events(self, req: RouterRequest) -> AsyncIterator[StreamEvent]:
        """The events of a submitted request; closing this iterator early aborts the request."""
        try:
            while True:
                for ev in await req.events.take():
                    if isinstance(ev, BaseException):
                        raise ev
                    yield self._with_text(req, ev)
                    if ev.finish_reason is not None:
                        return
        finally:
            self._requests.abort(req)

    def _with_text(self, req: RouterRequest, ev: StreamEvent) -> StreamEvent:
        try:
            return req.with_text(ev)
        except Exception as e:  # a token that will not detokenize fails its request, as at commit
            raise self._requests.failed_text(req, ev, e) from None

    async def generate(self, prompt: Prompt, **kwargs: Any) -> GenerateResult:
        """The whole answer at once; `prompt` and `kwargs` as in `stream`."""
        req = self.submit(prompt, **kwargs)
        try:
            evs = await req.events.take(whole=True)  # woken once, at the end
        finally:
            self._requests.abort(req)  # (a no-op when it ended; a caller cancelled aborts it)
        ids, models, text, reason = [], [], [], ""
        for ev in evs:
            if isinstance(ev, BaseException):
                raise ev
            ev = self._with_text(req, ev)
            if ev.token_id is not None:
                ids.append(ev.token_id)
                models.append(ev.model)
            text.append(ev.text)
            reason = ev.finish_reason or reason
        # the events' own, one per token (the closing event without a token has none)
        logprobs = [ev.logprob for ev in evs if ev.token_id is not None] if req.sampling.logprobs is not None else None
        n_prompt = req.num_prompt_tokens
        usage = {"prompt_tokens": n_prompt, "completion_tokens": len(ids), "total_tokens": n_prompt + len(ids),
                 "per_model": {n: models.count(n) for n in self.names}}
        return GenerateResult("".join(text), ids, models, reason, usage, logprobs)

    async def score(self, prompt: Prompt, *, top_logprobs: int = 0, policy: Policy | None = None) -> ScoreResult:
        """The routed log probability of each token of `prompt` (a `Prompt`; text is tokenized as
        `prompt_ids` does, BOS included), teacher-forced: each position scored by the model the
        policy routes it to, the policy seeing what it would see while generating that text
        (aiorouter/scoring.py says exactly what, and what "the prompt" is to a policy: the first
        token). With `single`, the entry model's values. `top_logprobs`: that many alternatives per
        position (at most 20). Each model the policy reaches prefills the text once; the KV pages
        it takes are back in the pool when this returns. The first token has no value (None).
        Bad input is a ValueError; a policy that cannot be replayed so (or raises) a RouterError
        naming it; a model whose KV pool has too few free pages now, RouterUnavailable (retry)."""
        self._require_serving()
        k = requested(True, top_logprobs)
        ids = self.prompt_ids(prompt)
        self.check_prompt(ids)
        pol = self._request_policy(policy)
        first = self.tokenizer.decode(ids[:scoring.PROMPT_TOKENS]) if pol.admits and self.tokenizer is not None else None
        models = [scoring.ScoredModel(s.name, s.engine, s.worker, x) for s, x in zip(self.subservers, self._extra_rows)]
        try:
            return await scoring.score(models, pol, self.entry, ids, k, first)
        except RouterError:
            raise
        except Exception as e:  # the input was checked above: a policy's (or a model's) failure, named
            raise RouterError(f"scoring under policy {pol.name!r} failed: {e!r}") from e
