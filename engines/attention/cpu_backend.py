"""CPU attention backend: a paged-attention kernel (engines/csrc) for decodes and short extends.

Decode attention on CPU through torch ops has to gather each sequence's K/V out of the pool into
a padded batch and then run SDPA, whose CPU flash kernel is blocked for long queries; at batch 32
that was half of a SmolLM2 decode step. The kernel reads the pool through the block tables
instead, in float32, one (sequence, KV head) per work item on torch's intra-op threads: 2.3x
faster per layer at batch 32 (bf16 and fp32). Extends longer than `KERNEL_MAX_Q` (prefill chunks)
keep SDPA, which is GEMM-shaped there. A layer's window, scale and softcap go to the kernel as
arguments (a window also skips the kernel's work on older keys) and to `sdpa.run_layer_extends`.

The kernel is built with the other CPU kernels (engines/cpu_kernels.py); if it cannot be built,
`select_backend` warns once and uses the portable TorchBackend.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engines import cpu_kernels
from engines.attention.base import FULL, AttentionBackend, BatchLayout, LayerAttn
from engines.attention.sdpa import Extend, plan_extend, run_extends, run_layer_extends

def load():
    """-> the paged attention op, or None if the CPU kernels cannot be built here (warned once)."""
    ops = cpu_kernels.load()
    return ops.paged_attention if ops is not None else None


KERNEL_MAX_Q = 16  # longer extends run as SDPA: GEMM-shaped work the kernel's dot loops do badly


class CpuMeta(NamedTuple):
    slot_mapping: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [B, max_pages] int64, contiguous
    page_size: int
    seqs: torch.Tensor | None  # [n, 4] int64 (block-table row, q_start, q_len, kv_len) for the kernel
    extends: list[Extend]  # the long extends, for SDPA
    memo: dict  # per step: windowed layers' extend masks, built by the first such layer


class CpuBackend(AttentionBackend):
    """The kernel for decodes and extends of <= KERNEL_MAX_Q tokens (handoff resumes); SDPA for
    the rest. Same results as TorchBackend to float32 rounding (tests/test_cpu_attention.py)."""

    def __init__(self, op) -> None:
        self._op = op

    def plan(self, layout: BatchLayout) -> CpuMeta:
        rows, extends, q0 = [], [], 0
        for i, (q_len, kv_len) in enumerate(zip(layout.q_lens, layout.kv_lens)):
            if q_len <= KERNEL_MAX_Q:
                rows.append((i, q0, q_len, kv_len))
            else:
                extends.append(plan_extend(layout, i, q0))
            q0 += q_len
        seqs = torch.tensor(rows, dtype=torch.int64) if rows else None
        return CpuMeta(layout.slot_mapping, layout.block_tables.contiguous(), layout.page_size, seqs, extends, {})

    def forward(self, q, k, v, k_cache, v_cache, meta: CpuMeta, layer: LayerAttn = FULL):
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        T, h, d = q.shape
        out = torch.empty(T, h, d, dtype=q.dtype)
        if layer == FULL:
            if meta.seqs is not None:
                self._op(q, k_cache, v_cache, meta.block_tables, meta.seqs, meta.page_size, d ** -0.5, out)
            run_extends(q, k, v, k_cache, v_cache, meta.extends, out)
            return out
        if meta.seqs is not None:  # the kernel's window starts its key loops at the window: older keys cost nothing
            scale = layer.scale if layer.scale is not None else d ** -0.5
            self._op(q, k_cache, v_cache, meta.block_tables, meta.seqs, meta.page_size, scale, out, layer.window,
                     layer.softcap)
        run_layer_extends(q, k, v, k_cache, v_cache, meta.extends, out, layer, meta.memo)
        return out
