"""Runs one forward step of a model over a mixed batch of decodes and extends, then samples.

On CUDA a runner launches everything on its own stream(s) (one per device of its group), so two
models' steps overlap, and waits for the step's event in the calling thread (the subserver's
worker), never on the event loop. Small steps replay CUDA graphs (engines/cuda_graph.py) when the
backend is graph-safe; sampling stays on the GPU until the tokens are copied out once.
The CUDA paths have not run on a GPU yet (bench/gpu/check.py is their check); CPU runs as before.
"""
from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch

from engines import cpu_kernels
from engines.attention import AttentionBackend, BatchLayout, has_module, select_backend
from engines.config import EngineConfig, ModelConfig
from engines.cuda_graph import DECODE_BUCKETS, StepGraphs
from engines.devices import LayerSlice, StageKV, host_tensor, split_layers
from engines.kv_cache import KVPool
from engines.logprobs import TokenLogprob, step_logprobs
from engines.model import AttnContext, CausalLM, rope_cache, signed_sin
from engines.sampling import nonfinite_host_rows, nonfinite_rows, sample, sample_batched
from engines.scoring import PromptScores, chunk_scores
from engines.sequence import Sequence
from engines.streams import StreamFactory


# Called before each layer of a CPU step, in the stepping thread: an owner that shares the cores
# between models (aiorouter.cpu_threads.CoreShare) resizes that thread's OpenMP team there.
LayerHook = Callable[[], None]


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_tokens: int  # tokens to compute: token_ids[num_computed : num_computed + num_tokens]


class ForwardOutput(NamedTuple):
    """One row per sequence that reached the end of its known tokens (so has a next token)."""

    seqs: list[Sequence]
    logits: torch.Tensor  # [B, rows] float32, raw (before temperature or filtering): every output row,
    # reserved ones too (rows = vocab + reserved; see `run`'s sample_vocab)
    next_tokens: list[int]  # [B] sampled with each sequence's SamplingParams
    hidden: torch.Tensor | None  # [B, hidden] final-normed last hidden state, when asked for
    bad_rows: tuple[int, ...] = ()  # rows whose logits hold NaN/inf: placeholder tokens, the sequence must fail
    # [B] int64 on the host: next_tokens as the sampler's tensor, made in the worker thread (a policy
    # reads it; built again on the event loop, every torch call there lets a worker take the GIL)
    sampled: torch.Tensor | None = None
    # [B] per row the log probability of its token (engines/logprobs.py), None for a row that did
    # not ask; None when no row of the step asked
    logprobs: tuple[TokenLogprob | None, ...] | None = None


class Stage(NamedTuple):
    """One device of a group: its layers, their KV, its backend and rotary tables."""
    device: torch.device
    layers: range
    kv: KVPool | StageKV
    backend: AttentionBackend
    cos: tuple[torch.Tensor, ...]  # per rope of the model: [max_len, 1, D] in the model dtype
    sin: tuple[torch.Tensor, ...]  # the same, rotate_half's sign folded in


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: ModelConfig, ecfg: EngineConfig, dtype: torch.dtype,
                 device: torch.device, backend: AttentionBackend | None = None, max_model_len: int = 4096,
                 devices: list[torch.device] | None = None, streams: StreamFactory | None = None):
        """`devices`: a group (pipeline stages, `engines.devices.parse_devices`); `device` is its first.
        `backend` (an instance, single device) or `ecfg.attention_backend` forces the attention
        backend; `ecfg.cuda_graphs` captures small steps (CUDA, one device). `streams`: the factory
        of the process's model streams (engines/streams.py; one of its own when None)."""
        devices = devices or [device]
        self.model, self.cfg, self.dtype, self.device = model, cfg, dtype, devices[0]
        self.page_size, self.max_model_len, self.max_num_seqs = ecfg.page_size, max_model_len, ecfg.max_num_seqs
        ranges = split_layers(cfg.num_hidden_layers, len(devices))
        if len(devices) > 1:
            model.place(devices, ranges)
        elif self.device.type == "cpu":
            model.pack_weights()  # oneDNN-packed linears: see model.Linear
            ops = cpu_kernels.load()  # None (warned) without a compiler: torch ops then
            if ops is not None:
                model.use_cpu_kernels(ops)
        tables = rope_cache(cfg, max_model_len, torch.device("cpu"))  # per rope: [max_len, D] fp32 each
        # Cast once here (HF casts per layer, to the same values) and fold rotate_half's sign into sin.
        cos = tuple(c.to(dtype)[:, None, :] for c, _ in tables)  # [max_len, 1, D] each
        sin = tuple(signed_sin(s).to(dtype)[:, None, :] for _, s in tables)
        self.stages: list[Stage] = []
        for dev, layers in zip(devices, ranges):
            if len(devices) == 1:
                kv = KVPool(cfg, ecfg.num_pages, ecfg.page_size, dtype, dev)
            else:  # this stage's layers only, indexed by global layer id
                pool = KVPool(_with_layers(cfg, len(layers)), ecfg.num_pages, ecfg.page_size, dtype, dev)
                kv = StageKV(LayerSlice(pool.k, layers.start), LayerSlice(pool.v, layers.start))
            be = backend if backend is not None and len(devices) == 1 else select_backend(dev, ecfg.attention_backend)
            if hasattr(be, "bind"):  # backends that plan for fixed head shapes (flashinfer)
                be.bind(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, dtype)
            self.stages.append(Stage(dev, layers, kv, be, tuple(c.to(dev) for c in cos), tuple(s.to(dev) for s in sin)))
        self.kv, self.backend = self.stages[0].kv, self.stages[0].backend
        self.cuda = self.device.type == "cuda"
        # one stream per device, made for this runner alone (None on CPU): this model's kernels
        # and graph captures queue apart from every other model's
        streams = streams or StreamFactory()
        self.streams = [streams.stream(d, f"model runner {id(self):#x} (stage {i})") for i, d in enumerate(devices)]
        if self.cuda:
            for st in self.streams:
                st.wait_stream(torch.cuda.current_stream(st.device))  # after the weight and KV set-up
        self.graphs: StepGraphs | None = None
        if self.cuda and ecfg.cuda_graphs and len(devices) == 1:
            self.capture_graphs()

    def capture_graphs(self, backend: AttentionBackend | None = None, **buckets: tuple[int, ...]) -> StepGraphs | None:
        """Capture graphs for small steps on this runner's stream (on CPU: StepGraphs' stand-in,
        which tests use) and replay them from now on. `backend` must be graph-safe; by default
        this runner's backend, or, when that cannot be captured (flashinfer plans into its own
        buffers), the Triton backend when triton is installed (both read the same pool; None
        without it). `buckets`: StepGraphs' decode_buckets / seq_buckets / token_buckets."""
        if len(self.stages) > 1:
            raise ValueError("CUDA graphs are captured for one-device runners only (a device group runs eagerly)")
        be = backend or self.backend
        if not be.graph_safe:
            if not has_module("triton"):
                return None
            from engines.attention.triton_backend import TritonBackend
            be = TritonBackend()
        # no bigger batch than max_num_seqs ever runs
        buckets.setdefault("decode_buckets", tuple(b for b in DECODE_BUCKETS if b < self.max_num_seqs) + (self.max_num_seqs,))
        graphs = StepGraphs(self._forward_one, be, self.page_size, -(-self.max_model_len // self.page_size),
                            self.device, self.streams[0], **buckets)
        with self._on_streams():
            graphs.capture()
        self.graphs = graphs
        return graphs

    def _forward_one(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: object,
                     backend: AttentionBackend | None = None, layer_hook: LayerHook | None = None) -> torch.Tensor:
        """One device: ids, positions [T] -> hidden [T, hidden]. What a CUDA graph captures."""
        st = self.stages[0]
        ctx = AttnContext(backend or st.backend, meta, st.kv, tuple(c[positions] for c in st.cos),
                          tuple(s[positions] for s in st.sin))
        return self.model.forward_stages(input_ids, [(range(len(self.model.layers)), ctx)], layer_hook)

    def _on_streams(self) -> contextlib.ExitStack:
        """This runner's streams current on their devices, and its first device current."""
        stack = contextlib.ExitStack()
        if self.cuda:
            for st in self.streams:  # (setting a stream also switches the current device)
                stack.enter_context(torch.cuda.stream(st))
            stack.enter_context(torch.cuda.device(self.device))
        return stack

    def layout(self, batch: list[ScheduledSeq]) -> tuple[BatchLayout, torch.Tensor, torch.Tensor]:
        """-> (layout, input_ids [T], positions [T]), on the host (pinned on CUDA): a graph replay
        stages them into its own buffers, an eager step copies them up. `batch` lists decodes first."""
        ps = self.page_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        q_lens, kv_lens, num_decodes = [], [], 0
        for seq, n in batch:
            c = seq.num_computed_tokens
            if n == 1 and c > 0 and num_decodes == len(q_lens):
                num_decodes += 1
            ids.extend(seq.token_ids[c:c + n])
            pos.extend(range(c, c + n))
            bt = seq.block_table
            slots.extend(bt[t // ps] * ps + t % ps for t in range(c, c + n))
            q_lens.append(n)
            kv_lens.append(c + n)
        tables = [seq.block_table for seq, _ in batch]
        width = max(len(t) for t in tables)
        bt = self._host([t + [0] * (width - len(t)) for t in tables])  # [B, width]
        return BatchLayout(num_decodes, q_lens, kv_lens, self._host(slots), bt, ps, tables), self._host(ids), self._host(pos)

    def _host(self, values: list) -> torch.Tensor:
        """int64 on the host, pinned on CUDA: a copy from pageable memory would wait for the stream."""
        return torch.tensor(values, dtype=torch.int64, pin_memory=self.cuda)

    def forward(self, layout: BatchLayout, input_ids: torch.Tensor, positions: torch.Tensor,
                layer_hook: LayerHook | None = None) -> torch.Tensor:
        """Host layout -> hidden [T, hidden] on the last device: a graph replay when one fits, else eager."""
        if len(self.stages) == 1:
            key = self.graphs.key_for(layout) if self.graphs is not None else None
            if key is not None:
                return self.graphs.run(key, layout, input_ids, positions)
            dev = self.device
            layout = layout._replace(slot_mapping=up(layout.slot_mapping, dev), block_tables=up(layout.block_tables, dev))
            return self._forward_one(up(input_ids, dev), up(positions, dev), self.backend.plan(layout),
                                     layer_hook=layer_hook)
        ctxs = []
        for st in self.stages:  # the step's metadata on every device of the group
            lay = layout._replace(slot_mapping=up(layout.slot_mapping, st.device),
                                  block_tables=up(layout.block_tables, st.device))
            pos = up(positions, st.device)
            ctxs.append((st.layers, AttnContext(st.backend, st.backend.plan(lay), st.kv, tuple(c[pos] for c in st.cos),
                                                tuple(s[pos] for s in st.sin))))
        return self.model.forward_stages(up(input_ids, self.device), ctxs)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], want_hidden: bool = False, sample_vocab: int | None = None,
            layer_hook: LayerHook | None = None, want_logprobs: bool = False) -> ForwardOutput:
        """Compute the scheduled tokens, write their K/V, and sample for every sequence whose
        known tokens are now all computed (a mid-prompt prefill chunk samples nothing).
        `sample_vocab`: sample token ids below it (None: every output row); the rows past it are
        not tokens (Co-LLM's deferral row), a routing policy reads them. The caller passes it and
        `layer_hook` per step, so one runner serves callers that want different ones.
        `want_logprobs`: a sequence of the engine asked for log probabilities, so the step looks for
        the rows that did (False: it looks at none; `Scheduler.num_logprobs`)."""
        # decodes first, longest context first: the attention backend pads decodes by length group
        batch = sorted(batch, key=lambda s: (not (s.num_tokens == 1 and s.seq.num_computed_tokens > 0),
                                             -s.seq.num_computed_tokens))
        rows, seqs, end = [], [], 0
        for seq, n in batch:
            end += n
            if seq.num_computed_tokens + n == len(seq.token_ids):
                rows.append(end - 1)
                seqs.append(seq)
        with self._on_streams():
            layout, input_ids, positions = self.layout(batch)
            hidden = self.forward(layout, input_ids, positions, layer_hook)  # [T, hidden]
            if not rows:  # a prefill chunk: nothing to wait for (later steps queue behind it)
                return ForwardOutput([], torch.empty(0, self.cfg.vocab_size), [], None)
            last = hidden[host_tensor(rows, torch.int64, hidden.device)]  # [B, hidden]
            logits = self.model.compute_logits(last)  # [B, vocab] fp32
            params, gens = [s.sampling for s in seqs], [s.generator for s in seqs]
            tok_logits = logits if sample_vocab is None else logits[:, :sample_vocab]  # [B, V]
            if not self.cuda:  # NaN/inf rows: those sequences fail alone, the rest commit
                bad_rows = nonfinite_host_rows(tok_logits)
                tokens = sample(tok_logits, params, gens, bad_rows, seqs)
                lp = step_logprobs(tok_logits, tokens, [p.logprobs for p in params]) if want_logprobs else None
                return ForwardOutput(seqs, logits, tokens.tolist(), last.float() if want_hidden else None, bad_rows,
                                     tokens, lp.entries(len(seqs)) if lp is not None else None)
            bad = nonfinite_rows(tok_logits)  # [B] bool, read back with the tokens
            tokens = sample_batched(tok_logits, params, gens, seqs)
            lp = step_logprobs(tok_logits, tokens, [p.logprobs for p in params]) if want_logprobs else None
            if lp is not None:
                lp = lp.to_host()  # copies queued before the event: read once it has fired
            # the step's only wait: copies into pinned memory, then one event, waited on in this thread
            host = [t.to("cpu", non_blocking=True) for t in (tokens, logits, bad, last.float() if want_hidden else None)
                    if t is not None]
            done = torch.cuda.Event()
            done.record(self.streams[-1])
        done.synchronize()
        return ForwardOutput(seqs, host[1], host[0].tolist(), host[3] if want_hidden else None,
                             tuple(host[2].nonzero().flatten().tolist()), host[0],
                             lp.entries(len(seqs)) if lp is not None else None)


    @torch.inference_mode()
    def score(self, seq: Sequence, chunk: int, vocab: int, k: int, want_logits: bool, want_hidden: bool
              ) -> PromptScores:
        """Prompt scoring (engines/scoring.py): prefill `seq`'s tokens but the last, in chunks of
        `chunk` tokens, into the pages its block table holds, and score each position's next token
        from that chunk's logits, batched per chunk. Samples nothing; `seq` is the caller's to free."""
        ids = seq.token_ids
        n_pos = len(ids) - 1  # positions with a next token to score
        targets = self._host(ids[1:])
        parts: list[tuple[torch.Tensor | None, ...]] = []
        with self._on_streams():
            for start in range(0, n_pos, chunk):
                n = min(chunk, n_pos - start)
                seq.num_computed_tokens = start  # this chunk computes ids[start:start + n] over the ones before
                layout, input_ids, positions = self.layout([ScheduledSeq(seq, n)])
                hidden = self.forward(layout, input_ids, positions)  # [n, hidden]
                logits = self.model.compute_logits(hidden)  # [n, rows] fp32
                token, top_ids, top = chunk_scores(logits, up(targets[start:start + n], logits.device), vocab, k)
                parts.append(tuple(t.to("cpu") if t is not None else None for t in
                                   (token, top_ids, top, logits if want_logits else None,
                                    hidden.float() if want_hidden else None)))
            seq.num_computed_tokens = n_pos

        def cat(i: int) -> torch.Tensor | None:
            return torch.cat([p[i] for p in parts]) if parts and parts[0][i] is not None else None
        if not parts:  # a one-token text: nothing to score
            return PromptScores(torch.empty(0), None, None, None, None)
        return PromptScores(*(cat(i) for i in range(5)))


def _with_layers(cfg: ModelConfig, n: int) -> ModelConfig:
    from dataclasses import replace
    return replace(cfg, num_hidden_layers=n)


def up(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (pinned on CUDA) on `device`, without a stream sync; itself on the CPU."""
    return t.to(device, non_blocking=True)
