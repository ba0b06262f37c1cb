"""`Engine`: one model served offline with continuous batching (vLLM's `LLM` in spirit). A step is
schedule -> execute -> finish -> commit, written once (`step_async`): an owner that routes awaits it
with the forward in its worker thread and its policy choosing the tokens that stay; `step`, the
engine alone, runs the same coroutine on the caller's thread and keeps every token."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Coroutine, Iterable, NamedTuple, Sequence as Seq, TypeVar

import torch

from engines.block_manager import BlockManager
from engines.config import EngineConfig, ModelConfig
from engines.devices import parse_devices
from engines.grammar import Grammars
from engines.logprobs import TokenLogprob
from engines.output import Commit, OutputStream
from engines.runner import ForwardOutput, LayerHook, ModelRunner, ScheduledSeq
from engines.sampling import SamplingParams
from engines.scheduler import Scheduler
from engines.scoring import PromptScores
from engines.sequence import Sequence
from engines.streams import StreamFactory
from engines.weights import load_model
from engines.worker import Worker

log = logging.getLogger("aiorouter.engine")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass
class GenerateOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprob] | None = None  # per output token, when the request asked (SamplingParams.logprobs)


class KVUsage(NamedTuple):
    pages_total: int
    pages_used: int  # referenced by live sequences
    pages_free: int  # free now, or cached but evictable
    pages_cached: int  # held by the prefix cache
    prefix_matches: int  # admissions that ran prefix matching (a handoff-resume must not)
    preemptions: int
    parked: int  # sequences kept out of batches while a peer serves them
    ready: int  # sequences a step could compute now (waiting or running)
    # prompt tokens admissions found in the prefix cache (not computed), and tokens computed as part
    # of an extend (a prompt, a chunk of one, a resume): together, how often a prompt was prefilled
    prefix_hit_tokens: int = 0
    prefill_tokens: int = 0


class RunSpan(NamedTuple):
    """One forward as the owner's worker ran it (perf_counter seconds) and what it computed."""

    start: float
    end: float
    batch: int  # sequences in the step
    tokens: int  # tokens computed, all sequences together


@dataclass(frozen=True)
class StepReport:
    """What one step did (`Engine.step_async`), for its owner to publish and count."""

    launched: float  # perf_counter when the batch was scheduled: where each of `waits` ends
    returned: float  # when the forward came back from the worker (its last part, when isolated)
    finished: float  # when the batch's sequences were advanced: the step's cost ends here
    waits: tuple[float, ...]  # seconds each newly ready sequence waited to join a batch
    spans: tuple[RunSpan, ...]  # one per forward that returned: the batch's, or its parts'
    failed: tuple[tuple[Sequence, Exception], ...]  # sequences whose forward raised even alone
    bad: tuple[Sequence, ...]  # NaN/inf logits: nothing decided or committed, the sequence must fail
    commits: tuple[tuple[Sequence, int, Commit | Exception], ...]  # per kept token: as `commit` returned it
    # per kept token, in `commits`' order, its log probability (None where its request did not ask);
    # None when no row of the step asked (engines/logprobs.py)
    logprobs: tuple[TokenLogprob | None, ...] | None = None


class Decided(NamedTuple):
    """An owner's decision over a step's rows (`Decide`)."""

    stays: list[tuple[Sequence, int]]  # (sequence, sampled token) committed here
    leaves: list[Sequence]  # handed to something outside the engine: parked here, their KV kept


Forward = Callable[[list[ScheduledSeq]], ForwardOutput]  # a batch's forward, as the worker thread runs it
Decide = Callable[[ForwardOutput, list[int]], Awaitable[Decided]]  # (output, its finite rows) -> Decided
T = TypeVar("T")


async def _keep_all(out: ForwardOutput, rows: list[int]) -> Decided:  # no policy: every token stays
    return Decided([(out.seqs[r], out.next_tokens[r]) for r in rows], [])


async def _on(worker: Worker | None, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in `worker`'s thread, the caller's event loop going on meanwhile; None: right here."""
    return fn(*args) if worker is None else await worker.call(fn, *args)


def _complete(step: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine none of whose awaits suspends (no worker, `_keep_all`): the engine
    alone runs `step_async` to its end on the caller's thread, with no event loop."""
    try:
        step.send(None)
    except StopIteration as done:
        return done.value
    step.close()
    raise RuntimeError("a step suspended without an event loop: await Engine.step_async instead")


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prefill_tokens: int = 0  # tokens computed as part of an extend (prompt, chunk or resume)
    num_decode_tokens: int = 0


class Engine:
    def __init__(self, model_path: str | Path, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype = "float32", config: EngineConfig | None = None,
                 load_tokenizer: bool = True, streams: StreamFactory | None = None):
        """`device`: "cpu", "cuda:0", or a group "cuda:0,1" (layers split across it, in order).
        The attention backend, CUDA graphs and random weights are `config`'s (EngineConfig).
        `streams`: the factory of the CUDA streams of every model in this process (a router
        passes its own; engines/streams.py); None: the runner makes one of its own."""
        self.path = Path(model_path)
        model_config = ModelConfig.from_dir(self.path)
        devices, dtype = parse_devices(device), parse_dtype(dtype)
        device = devices[0]
        ecfg = self._fit_config(config or EngineConfig(), model_config)
        tokenizer = self._load_tokenizer() if load_tokenizer else None
        # a group loads on the host and the runner places each stage's layers on its device
        model = load_model(self.path, model_config, dtype, device if len(devices) == 1 else torch.device("cpu"),
                           ecfg.load_format, ecfg.quantization)
        runner = ModelRunner(model, model_config, ecfg, dtype, device, max_model_len=ecfg.max_model_len,
                             devices=devices, streams=streams)
        self._setup(model_config, ecfg, runner, tokenizer, devices, dtype)
        log.info("loaded %s (%s, %s): %d KV pages of %d tokens, max_model_len %d", self.path.name, ",".join(map(str, devices)),
                 str(dtype).removeprefix("torch."), ecfg.num_pages, ecfg.page_size, ecfg.max_model_len)

    @staticmethod
    def _fit_config(ecfg: EngineConfig, model_config: ModelConfig) -> EngineConfig:
        # A lone sequence must always fit in the pool, so the context never exceeds it.
        cap = ecfg.num_pages * ecfg.page_size
        return replace(ecfg, max_model_len=min(ecfg.max_model_len or model_config.max_position_embeddings, cap))

    def _setup(self, model_config: ModelConfig, ecfg: EngineConfig, runner, tokenizer, devices: list[torch.device],
               dtype: torch.dtype) -> None:
        self.model_config, self.config, self.runner, self.tokenizer = model_config, ecfg, runner, tokenizer
        self.devices, self.device, self.dtype = devices, devices[0], dtype  # a group's layers span its devices
        self.max_model_len: int = ecfg.max_model_len
        self.block_manager = BlockManager(ecfg.num_pages, ecfg.page_size, ecfg.enable_prefix_caching)
        self.scheduler = Scheduler(ecfg, self.block_manager)
        self.stats = EngineStats()
        self._reserved_rows = 0  # output rows past the token vocabulary (reserve_output_rows)
        self._grammars: Grammars | None = None  # made by the first structured request (`grammars`)
        self._scoring: dict[int, BlockManager] = {}  # id(sequence) -> the pool a score took its pages from

    @property
    def vocab_size(self) -> int:
        """Token ids this engine samples and accepts: the output rows less the reserved ones."""
        return self.model_config.vocab_size - self.reserved_rows

    @property
    def reserved_rows(self) -> int:
        return self._reserved_rows

    def reserve_output_rows(self, n: int) -> None:
        """The last `n` rows of the output head are not tokens (Co-LLM's deferral row is the one
        past the vocabulary): they are never sampled, a prompt may not use them, and the step's
        logits still carry them for whoever reads them. 0 undoes it. For this engine's own
        requests (`generate`); a router passes its reservation per step instead (`execute`), so
        an engine it was handed is left as it was."""
        self._reserved_rows = self.check_reserved_rows(n)

    def check_reserved_rows(self, n: int) -> int:
        """-> n, when `n` rows of the output head may be reserved (ValueError otherwise)."""
        rows = self.model_config.vocab_size
        if not 0 <= n < rows:
            raise ValueError(f"cannot reserve {n} of the model's {rows} output rows")
        return n

    @property
    def num_params(self) -> int:
        """Weights the model reads per step (0 for a weightless sim): how heavy its steps are."""
        model = getattr(self.runner, "model", None)
        return sum(p.numel() for p in model.parameters()) if model is not None else 0

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                        **engine_config: object) -> "Engine":
        """`engine_config`: EngineConfig fields (page_size, num_kv_tokens, attention_backend, ...)."""
        return cls(path, device=device, dtype=dtype, config=EngineConfig(**engine_config))

    def _load_tokenizer(self):
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(str(self.path))
        except Exception as e:  # a directory with weights but no tokenizer still serves token ids
            log.warning("no tokenizer in %s (%s); token-id prompts only", self.path, e)
            return None

    # -- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids")
            if not prompt:
                raise ValueError("prompt is empty")
            return self.tokenizer.encode(prompt) or []  # with the tokenizer's BOS, as Router.prompt_ids
        return list(prompt)

    def validate_prompt(self, ids: list[int], reserved_rows: int | None = None) -> None:
        """`reserved_rows`: output rows past the tokens (None: this engine's own, reserve_output_rows)."""
        if not ids:
            raise ValueError("prompt is empty")
        V = self.model_config.vocab_size - (self.reserved_rows if reserved_rows is None else reserved_rows)
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {V})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                             "(prompt plus at least one generated token must fit)")

    def validate_sampling(self, params: SamplingParams, reserved_rows: int | None = None) -> None:
        """The token ids `params` names are this model's: a logit_bias or stop_token_ids entry past
        the vocabulary would otherwise fail the steps of every request batched with it."""
        V = self.model_config.vocab_size - (self.reserved_rows if reserved_rows is None else reserved_rows)
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {V})")

    def add(self, token_ids: list[int], sampling: SamplingParams, num_prompt_tokens: int | None = None,
            user_data: object = None, output: OutputStream | None = None, want_hidden: bool = False) -> Sequence:
        """A new sequence for this engine, ready now (prefix matching and admission happen when it
        is scheduled). The router adds a request's tokens as this model has seen them, with its own
        handle in user_data and the request's output stream, which `commit` feeds. `want_hidden`:
        the steps it is in return hidden states (its policy reads them)."""
        seq = Sequence(token_ids, sampling, num_prompt_tokens=num_prompt_tokens or len(token_ids), user_data=user_data,
                       output=output, t_ready=time.perf_counter(), want_hidden=want_hidden)
        self.scheduler.add(seq)
        return seq

    def resume(self, seq: Sequence, new_tokens: list[int]) -> None:
        """Handoff-resume: a parked sequence gets the tokens it has not seen and extends over them
        with the KV pages it kept (no prefix matching, no new admission); it is ready now."""
        self.scheduler.resume(seq, new_tokens)
        seq.t_ready = time.perf_counter()

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll the sequence back to its first `num_tokens` tokens (at least its prompt), between
        steps: a model whose view of a request changed under it (a peer's text re-tokenized across
        vocabularies) drops its tail here and `resume`s with the new one. Its K/V past the cut go
        back to the pool (pages the prefix cache holds stay cached), a cached page is never written
        again (its kept part is recomputed instead), and the next step computes from the cut."""
        self.scheduler.truncate(seq, num_tokens)

    def release(self, seq: Sequence, reason: str) -> None:
        """The sequence is over here: its pages go back to the pool, full ones into the prefix cache."""
        self.scheduler.finish(seq, reason)

    @property
    def num_ready(self) -> int:
        """Sequences a step could compute now (parked ones excluded)."""
        return self.scheduler.num_ready

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler)

    def kv_usage(self) -> KVUsage:
        bm = self.block_manager
        return KVUsage(bm.num_pages, bm.num_used_pages, bm.num_free_pages, bm.num_cached_pages,
                       bm.num_prefix_matches, self.scheduler.num_preemptions, len(self.scheduler.parked),
                       self.scheduler.num_ready, bm.num_hit_tokens, self.stats.num_prefill_tokens)

    def reset(self) -> None:
        """Forget every sequence: a fresh scheduler, block manager and prefix cache over the same
        weights and KV pool. What a router does to a model whose subserver died, after it failed
        every request: the sequences of that state may be half-scheduled, so none of it is kept.
        The K/V values left in the pool are overwritten before any page table points at them."""
        ecfg = self.config
        self.block_manager = BlockManager(ecfg.num_pages, ecfg.page_size, ecfg.enable_prefix_caching)
        self.scheduler = Scheduler(ecfg, self.block_manager)

    def reset_prefix_cache(self) -> int:
        """Forget every cached page that no live sequence holds (a server's cache flush between
        benchmark runs, like SGLang's /flush_cache); returns the pages freed."""
        return self.block_manager.reset_prefix_cache()

    # -- prompt scoring (engines/scoring.py) -----------------------------------------------------
    # Three parts, as a step's: the pages are taken and given back on the owner's thread (the
    # scheduler's), the prefill runs where the owner runs forwards (its worker), between its steps.
    def score_begin(self, token_ids: list[int], reserved_rows: int | None = None) -> Sequence:
        """A sequence outside the scheduler holding the KV pages the text's prefill writes, taken
        from the pool now. ValueError for a bad text, or when the pool has too few free pages now."""
        self.validate_prompt(token_ids, reserved_rows)
        seq = Sequence(list(token_ids), SamplingParams(max_tokens=1))
        if not self.block_manager.reserve(seq, len(token_ids) - 1):
            raise ValueError(f"scoring {len(token_ids)} tokens needs {self.block_manager.pages_needed(seq, len(token_ids) - 1)} "
                             f"KV pages; {self.block_manager.num_free_pages} are free now")
        self._scoring[id(seq)] = self.block_manager
        return seq

    def score_run(self, seq: Sequence, k: int = 0, want_logits: bool = False, want_hidden: bool = False,
                  reserved_rows: int | None = None) -> PromptScores:
        """The prefill of `score_begin`'s sequence -> every position's scores, with the `k` most
        probable tokens of each, and its raw logits and hidden states when asked (a policy reads
        them). `reserved_rows` as in `execute`: those rows are not tokens, never scored."""
        n = self.reserved_rows if reserved_rows is None else reserved_rows
        return self.runner.score(seq, self.config.max_num_batched_tokens, self.model_config.vocab_size - n, k,
                                 want_logits, want_hidden)

    def score_end(self, seq: Sequence) -> None:
        """Its pages go back to the pool (none were offered to the prefix cache); after a `reset`
        meanwhile, the pool they came from is gone and nothing is given back."""
        if self._scoring.pop(id(seq), None) is self.block_manager:
            self.block_manager.free(seq)

    def score(self, prompt: str | list[int], k: int = 0) -> PromptScores:
        """The engine alone: the log probability this model gives each token of `prompt` but the
        first (teacher-forced, one prefill), with its `k` most probable alternatives."""
        ids = self.tokenize(prompt)
        seq = self.score_begin(ids)
        try:
            return self.score_run(seq, k)
        finally:
            self.score_end(seq)

    # -- one step: schedule -> execute -> finish -> commit --------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        """Pick this step's sequences and reserve their KV (on the owner's thread: the event loop)."""
        return self.scheduler.schedule()

    @staticmethod
    def waits(batch: list[ScheduledSeq], now: float) -> list[float]:
        """Seconds each sequence of a scheduled batch waited since it became ready (added, resumed or
        given a token), for those that waited: each wait is counted once (the admission delay)."""
        out = []
        for seq, _ in batch:
            if seq.t_ready is not None:
                out.append(now - seq.t_ready)
                seq.t_ready = None
        return out

    def execute(self, batch: list[ScheduledSeq], want_hidden: bool | None = None, reserved_rows: int | None = None,
                layer_hook: LayerHook | None = None) -> ForwardOutput:
        """Run the forward and sample. Touches only the runner, so the router calls it in the model's
        worker thread while the loop goes on. `want_hidden` None: when a sequence of the batch wants
        them (`add`). `reserved_rows`: output rows never sampled (None: this engine's own);
        `layer_hook`: runs before each layer of a CPU step (cpu_threads.CoreShare). Both come per
        call: a router's choices stay the router's, the engine is not changed. Log probabilities
        are computed for the rows that ask while a live sequence has asked (`Scheduler.num_logprobs`,
        read here in the worker thread: a sequence that ends meanwhile has no token left to take them)."""
        n = self.reserved_rows if reserved_rows is None else reserved_rows
        if want_hidden is None:
            want_hidden = any(seq.want_hidden for seq, _ in batch)
        return self.runner.run(batch, want_hidden, self.model_config.vocab_size - n if n else None, layer_hook,
                               self.scheduler.num_logprobs > 0)

    def finish(self, batch: list[ScheduledSeq], out: ForwardOutput) -> ForwardOutput:
        """The batch's K/V are written: advance the sequences and count the step. Tokens are not
        appended: the caller decides (`step_async` commits those its owner keeps; a router may hand
        the others off)."""
        self.scheduler.commit(batch)
        for row in out.bad_rows:  # NaN/inf logits: that sequence's K/V may be broken too, share none of it
            self.block_manager.uncache(out.seqs[row])
        st = self.stats
        st.num_steps += 1
        for seq, n in batch:
            if n == 1 and seq.num_computed_tokens > seq.num_prompt_tokens:
                st.num_decode_tokens += 1
            else:
                st.num_prefill_tokens += n
        return out

    def forward(self, want_hidden: bool = False) -> ForwardOutput | None:
        """One step without committing tokens (tests and tools that choose the token themselves)."""
        batch = self.schedule()
        return self.finish(batch, self.execute(batch, want_hidden)) if batch else None

    def step(self) -> list[Sequence]:
        """One continuous-batching step (`step_async` on this thread, every sampled token kept);
        returns the sequences that finished in it. A sequence whose logits were NaN/inf
        (`ForwardOutput.bad_rows`) finishes with "error"; the others go on. A forward that raises,
        or a token its stream refuses, raises here."""
        report = _complete(self.step_async(None, _keep_all, isolate=False))
        if report is None:
            return []
        for seq in report.bad:
            seq.output.finish("error")
            self.scheduler.finish(seq, "error")
        for _, _, c in report.commits:
            if isinstance(c, Exception):
                raise c
        if report.logprobs is not None:
            for (seq, _, _), lp in zip(report.commits, report.logprobs):
                if lp is not None and seq.logprobs is not None:
                    seq.logprobs.append(lp)
        return [s for s, _, _ in report.commits if s.is_finished] + list(report.bad)

    async def step_async(self, worker: Worker | None, decide: Decide, forward: Forward | None = None, *,
                         isolate: bool = True) -> StepReport | None:
        """One step for an owner that routes: schedule, the forward in the owner's `worker` thread
        (so the owner's event loop goes on meanwhile; None: on this thread), finish, then `decide`
        says which sampled tokens stay here, and they are committed and the ones that left parked.
        None when nothing could be scheduled. Rows with NaN/inf logits are never decided on: they
        come back in `bad`, for the owner to end. `forward`: the batch's forward as the worker runs
        it (None: `execute`). `isolate`: a forward that raises runs again in halves (`_isolating`);
        False: it raises here."""
        batch = self.schedule()
        if not batch:
            return None
        launched = time.perf_counter()
        waits = self.waits(batch, launched)
        failed: list[tuple[Sequence, Exception]] = []
        parts = await self._isolating(worker, forward or self.execute, batch, failed if isolate else None)
        returned = time.perf_counter()
        for part, out, _ in parts:
            self.finish(part, out)
        finished = time.perf_counter()
        stays: list[tuple[Sequence, int]] = []
        for _, out, _ in parts:
            bad = set(out.bad_rows)
            d = await decide(out, [r for r in range(len(out.seqs)) if r not in bad])
            stays += d.stays
            for seq in d.leaves:
                self.scheduler.park(seq)
        # All of the step's tokens in one call, after every decision: a request that ended while
        # the policy decided (a client gone) refuses its token here; each token committed is in the
        # report, for the owner to stream (a router does once its next step has launched).
        commits = tuple((seq, token, c) for (seq, token), c in zip(stays, self.commit(stays)))
        logprobs = None
        for _, out, _ in parts:  # (one part but when a step was isolated)
            if out.logprobs is not None:
                logprobs = self._stay_logprobs(parts, stays)
                break
        return StepReport(launched, returned, finished, tuple(waits), tuple(span for _, _, span in parts),
                          tuple(failed), tuple(out.seqs[r] for _, out, _ in parts for r in out.bad_rows), commits,
                          logprobs)

    @staticmethod
    def _stay_logprobs(parts: list[tuple[list[ScheduledSeq], ForwardOutput, RunSpan]],
                       stays: list[tuple[Sequence, int]]) -> tuple[TokenLogprob | None, ...]:
        """Per kept token, the log probability its row's step computed (each token kept is the one
        its row sampled). Only for a step where a row asked: a lookup per kept token."""
        found = {seq: lp for _, out, _ in parts if out.logprobs is not None
                 for seq, lp in zip(out.seqs, out.logprobs) if lp is not None}
        return tuple(found.get(seq) for seq, _ in stays)

    async def _isolating(self, worker: Worker | None, forward: Forward, batch: list[ScheduledSeq],
                         failed: list[tuple[Sequence, Exception]] | None
                         ) -> list[tuple[list[ScheduledSeq], ForwardOutput, RunSpan]]:
        """Run the batch -> [(part, its output, when the worker ran it)]. A step that raises is run
        again in halves, so a sequence that makes steps fail fails alone (into `failed`; about
        2*log2(B) extra steps for one such sequence in a batch of B) and the rest of the batch goes
        on. Rerunning is sound: a step that raised committed nothing (`finish` did not run), so its
        sequences compute the same positions again and rewrite their K/V slots with the same values.
        (A seeded sampled request that is rerun draws again, so its tokens are then not
        batch-independent.) `failed` None: the step's exception is raised instead."""
        try:
            return [(batch, *await _on(worker, self._timed, forward, batch))]
        except Exception as e:
            if failed is None:
                raise
            if len(batch) == 1:
                failed.append((batch[0].seq, e))
                return []
            log.exception("%s: a step of %d sequences failed; running it in halves to isolate the cause",
                          self.path.name if self.path is not None else "sim engine", len(batch))
        half = len(batch) // 2
        return await self._isolating(worker, forward, batch[:half], failed) + \
            await self._isolating(worker, forward, batch[half:], failed)

    @staticmethod
    def _timed(forward: Forward, batch: list[ScheduledSeq]) -> tuple[ForwardOutput, RunSpan]:
        t = time.perf_counter()
        out = forward(batch)
        return out, RunSpan(t, time.perf_counter(), len(batch), sum(n for _, n in batch))

    def commit(self, tokens: Iterable[tuple[Sequence, int]]) -> list[Commit | Exception]:
        """Commit a step's tokens, one per sequence: append it to the sequence, feed the sequence's
        output stream (stop checks, text), mark it ready again, and finish the sequence here when
        its output is over. The one place tokens are committed: `step_async` (and so `step`) and
        `append_token` come here. -> per token its `Commit`, or the exception its stream raised (a
        detokenizer that failed): the owner fails that request alone, and the other tokens commit."""
        now = time.perf_counter()
        got: list[Commit | Exception] = []
        for seq, token in tokens:
            out = seq.output
            try:
                if out.token_ids is not seq.token_ids:  # a router's request stream keeps a list of its own
                    seq.token_ids.append(token)
                c = out.append(token)
            except Exception as e:
                got.append(e)
                continue
            seq.t_ready = now
            if c.finish_reason is not None:
                self.scheduler.finish(seq, c.finish_reason)
            got.append(c)
        return got

    # -- the engine alone: requests with text (vLLM's LLM in spirit) ----------------------------
    @property
    def grammars(self) -> Grammars:
        """The compiler of this engine's structured outputs (its tokenizer's; made on first use, so
        an engine that never sees a structured request never loads xgrammar)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer: this engine has none")
            self._grammars = Grammars(self.tokenizer, self.model_config.eos_token_ids)
        return self._grammars

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> Sequence:
        ids = self.tokenize(prompt)
        self.validate_prompt(ids)
        params = params or SamplingParams()
        self.validate_sampling(params)
        # the stream appends to the sequence's own token list (tokenize made it): one list, committed once
        grammar = self.grammars.state(params.structured) if params.structured is not None else None
        out = OutputStream(ids, len(ids), params, self.model_config.eos_token_ids, self.max_model_len, self.tokenizer,
                           grammar=grammar)
        seq = self.add(ids, params, output=out)
        if params.logprobs is not None:  # `step` collects them here, `generate` returns them
            seq.logprobs = []
        return seq

    def append_token(self, seq: Sequence, token: int) -> str | None:
        """Commit one token (`commit` for one sequence); returns the finish reason if it is now done."""
        c = self.commit([(seq, token)])[0]
        if isinstance(c, Exception):
            raise c
        return c.finish_reason

    def output_of(self, seq: Sequence) -> OutputStream:
        """The output (tokens, streamed text, finish reason) of a request added with `add_request`."""
        return seq.output

    def abort(self, seq: Sequence) -> None:
        self.release(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.num_unfinished > 0

    def generate(self, prompts: str | list[int] | Seq[str | list[int]], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, use_tqdm: bool = False, **params: object) -> list[GenerateOutput]:
        """Generate for every prompt together. Keyword args build a `SamplingParams`
        (max_tokens, temperature, top_p, top_k, min_p, seed, stop, ignore_eos, ...)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams(**params)
        elif params:
            raise TypeError("pass either sampling_params or keyword sampling arguments, not both")
        plist = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        ids = [self.tokenize(p) for p in prompts]
        for i in ids:
            self.validate_prompt(i)  # all-or-nothing: a bad prompt rejects the call before any work
        seqs = [self.add_request(i, p) for i, p in zip(ids, plist)]
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            pbar = tqdm(total=len(seqs), desc="generate", unit="req")
        try:
            while any(not s.is_finished for s in seqs):
                done = self.step()
                if pbar is not None and done:
                    pbar.update(len(done))
        except BaseException:
            for s in seqs:
                self.abort(s)  # nothing leaks if a step fails or the caller interrupts
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [GenerateOutput(s.token_ids[:s.num_prompt_tokens], s.output_ids, s.output.text,
                               s.finish_reason or "", s.num_cached_tokens, s.logprobs) for s in seqs]
