"""Runs one forward step of a model over a mixed batch of decodes and extends, then samples."""
from __future__ import annotations

from typing import NamedTuple

import torch

from engines.attention import AttentionBackend, BatchLayout, select_backend
from engines.config import EngineConfig, ModelConfig
from engines.kv_cache import KVPool
from engines.model import AttnContext, CausalLM, rope_cache, signed_sin
from engines.sampling import sample
from engines.sequence import Sequence


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_tokens: int  # tokens to compute: token_ids[num_computed : num_computed + num_tokens]


class ForwardOutput(NamedTuple):
    """One row per sequence that reached the end of its known tokens (so has a next token)."""

    seqs: list[Sequence]
    logits: torch.Tensor  # [B, vocab] float32, raw (before temperature or filtering)
    next_tokens: list[int]  # [B] sampled with each sequence's SamplingParams
    hidden: torch.Tensor | None  # [B, hidden] final-normed last hidden state, when asked for


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: ModelConfig, ecfg: EngineConfig, dtype: torch.dtype,
                 device: torch.device, backend: AttentionBackend | None = None, max_model_len: int = 4096):
        self.model, self.cfg, self.dtype, self.device = model, cfg, dtype, device
        self.page_size = ecfg.page_size
        self.kv = KVPool(cfg, ecfg.num_pages, ecfg.page_size, dtype, device)
        self.backend = backend or select_backend(device)
        if device.type == "cpu":
            model.pack_weights()  # oneDNN-packed linears: see model.Linear
        cos, sin = rope_cache(cfg, max_model_len, device)  # [max_len, D] fp32
        # Cast once here (HF casts per layer, to the same values) and fold rotate_half's sign into sin.
        self.cos, self.sin = cos.to(dtype)[:, None, :], signed_sin(sin).to(dtype)[:, None, :]  # [max_len, 1, D]

    def layout(self, batch: list[ScheduledSeq]) -> tuple[BatchLayout, torch.Tensor, torch.Tensor]:
        """-> (layout, input_ids [T], positions [T]). `batch` must list decodes first."""
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
        max_pages = max(len(s.block_table) for s, _ in batch)
        bt = torch.zeros(len(batch), max_pages, dtype=torch.int64)
        for i, (seq, _) in enumerate(batch):
            bt[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int64)
        dev = self.device
        layout = BatchLayout(num_decodes, q_lens, kv_lens, torch.tensor(slots, dtype=torch.int64, device=dev),
                             bt.to(dev), ps)
        return layout, torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], want_hidden: bool = False) -> ForwardOutput:
        """Compute the scheduled tokens, write their K/V, and sample for every sequence whose
        known tokens are now all computed (a mid-prompt prefill chunk samples nothing)."""
        # decodes first, longest context first: the attention backend pads decodes by length group
        batch = sorted(batch, key=lambda s: (not (s.num_tokens == 1 and s.seq.num_computed_tokens > 0),
                                             -s.seq.num_computed_tokens))
        layout, input_ids, positions = self.layout(batch)
        meta = self.backend.plan(layout)
        ctx = AttnContext(self.backend, meta, self.kv, self.cos[positions], self.sin[positions])  # cos/sin [T, 1, D]
        hidden = self.model(input_ids, ctx)  # [T, hidden]
        rows, seqs, end = [], [], 0
        for seq, n in batch:
            end += n
            if seq.num_computed_tokens + n == len(seq.token_ids):
                rows.append(end - 1)
                seqs.append(seq)
        if not rows:
            return ForwardOutput([], torch.empty(0, self.cfg.vocab_size), [], None)
        last = hidden[torch.tensor(rows, device=hidden.device)]  # [B, hidden]
        logits = self.model.compute_logits(last)  # [B, vocab] fp32
        tokens = sample(logits, [s.sampling for s in seqs], [s.generator for s in seqs])
        return ForwardOutput(seqs, logits.cpu(), tokens.tolist(), last.float().cpu() if want_hidden else None)
