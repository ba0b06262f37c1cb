"""Triton attention backend: paged decode and extend kernels (engines/triton_kernels.py).

Its per-step metadata is a NamedTuple of device tensors plus two ints fixed by the batch's
shape, so a CUDA graph captured with one step's metadata replays with another's copied in
(engines/cuda_graph.py). A padded row has kv_len 0 and slot -1: it reads and writes nothing.

Ran here only on CPU tensors under the Triton interpreter (tests/test_triton_kernels.py checks it
against TorchBackend); bench/gpu/check.py is where it first runs compiled on a GPU.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engines.attention.base import FULL, AttentionBackend, BatchLayout, LayerAttn
from engines.devices import host_tensor
from engines.triton_kernels import extend_work, paged_decode, paged_extend, store_kv


class TritonMeta(NamedTuple):
    slot_mapping: torch.Tensor  # [T] int64, -1: padding, not written
    block_tables: torch.Tensor  # [B, max_pages] int32
    kv_lens: torch.Tensor  # [B] int32, context after this step (0: padding)
    qo_indptr: torch.Tensor  # [B+1] int32, query-token offsets
    work_seq: torch.Tensor  # [W] int32, extend query block -> sequence (-1: padding)
    work_mblk: torch.Tensor  # [W] int32, which BLOCK_M block of that sequence
    num_decodes: int  # rows [0, num_decodes) of q are one-token decodes
    page_size: int


class TritonBackend(AttentionBackend):
    graph_safe = True  # plan's tensors can be copied into a captured graph's buffers

    def __init__(self, block_m: int = 32, block_n: int = 64):
        self.block_m, self.block_n = block_m, block_n

    def plan(self, layout: BatchLayout) -> TritonMeta:
        dev = layout.slot_mapping.device
        nd, q_lens = layout.num_decodes, layout.q_lens
        indptr = [0]
        for n in q_lens:
            indptr.append(indptr[-1] + n)
        # extend tokens counted from the slot mapping: a step padded for a graph counts its padding,
        # so the work list's length depends on the padded shapes only
        seqs, blks = extend_work(q_lens, nd, self.block_m, layout.slot_mapping.shape[0] - indptr[nd])
        i32 = torch.int32
        return TritonMeta(layout.slot_mapping, layout.block_tables.to(i32), host_tensor(layout.kv_lens, i32, dev),
                          host_tensor(indptr, i32, dev), host_tensor(seqs, i32, dev), host_tensor(blks, i32, dev),
                          nd, layout.page_size)

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonMeta, layer: LayerAttn = FULL):
        # q [T, H, D], k/v [T, Hkv, D], caches [slots, Hkv, D]. Triton launches on the current CUDA
        # device: the caller makes it q's (ModelRunner per step, CausalLM.forward_stages per stage)
        if q.shape[-1] < 16:
            raise ValueError(f"the Triton backend needs head_dim >= 16 (tl.dot), got {q.shape[-1]}")
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        # the layer's options are host scalars: graphs capture them per layer, nothing reads the device
        scale = layer.scale if layer.scale is not None else q.shape[-1] ** -0.5
        nd, ps = meta.num_decodes, meta.page_size
        if nd:
            paged_decode(q[:nd], k_cache, v_cache, out[:nd], meta.block_tables, meta.kv_lens, ps, scale, self.block_n,
                         layer.window, layer.softcap)
        paged_extend(q, k_cache, v_cache, out, meta.block_tables, meta.kv_lens, meta.qo_indptr, meta.work_seq,
                     meta.work_mblk, ps, scale, self.block_m, self.block_n, layer.window, layer.softcap)
        return out
