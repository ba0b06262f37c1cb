"""flashinfer attention on CUDA: the paged prefill wrapper (causal) for extends, the paged decode
wrapper for decodes, one workspace per model, `plan` once per step.

Not exercised on the CPU machines this project is developed on: it runs only where a GPU is
lent (bench/gpu_check.py); `select_backend` never picks it for a CPU device. It is not
graph-safe (its wrappers plan into their own buffers), so the runner replays small steps with
the Triton backend's graphs instead; both read the same pool.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engines.attention.base import AttentionBackend, BatchLayout
from engines.paged_meta import build_paged_meta


class FlashInferMeta(NamedTuple):
    slot_mapping: torch.Tensor  # [T]
    num_decode_tokens: int
    has_decode: bool
    has_extend: bool
    page_size: int


class FlashInferBackend(AttentionBackend):
    def __init__(self, device: torch.device, workspace_bytes: int = 128 * 2**20):
        import flashinfer
        self.device = torch.device(device)
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.shape: tuple[int, int, int] | None = None  # (heads, kv heads, head dim), set by bind
        self.dtype: torch.dtype | None = None

    def bind(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.shape, self.dtype = (num_heads, num_kv_heads, head_dim), dtype

    def plan(self, layout: BatchLayout) -> FlashInferMeta:
        h, hkv, d = self.shape
        ps, nd = layout.page_size, layout.num_decodes
        # host lists: reading the device block tables back would wait for the stream
        bts = layout.host_block_tables if layout.host_block_tables is not None else layout.block_tables.tolist()
        i32 = dict(dtype=torch.int32)  # host tensors: plan reads indptr on the host and copies the rest up
        if nd:
            m = build_paged_meta(layout.q_lens[:nd], layout.kv_lens[:nd], bts[:nd], ps)
            self.decode.plan(torch.tensor(m.kv_indptr, **i32), torch.tensor(m.kv_indices, **i32),
                             torch.tensor(m.kv_last_page_len, **i32), h, hkv, d, ps,
                             q_data_type=self.dtype, kv_data_type=self.dtype)
        if nd < len(layout.q_lens):
            m = build_paged_meta(layout.q_lens[nd:], layout.kv_lens[nd:], bts[nd:], ps)
            self.prefill.plan(torch.tensor(m.qo_indptr, **i32), torch.tensor(m.kv_indptr, **i32),
                              torch.tensor(m.kv_indices, **i32), torch.tensor(m.kv_last_page_len, **i32),
                              h, hkv, d, ps, causal=True, q_data_type=self.dtype, kv_data_type=self.dtype)
        return FlashInferMeta(layout.slot_mapping, nd, nd > 0, nd < len(layout.q_lens), ps)

    def forward(self, q, k, v, k_cache, v_cache, meta: FlashInferMeta):
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        # the pool is [num_slots, Hkv, D]; flashinfer's NHD pages are [num_pages, page_size, Hkv, D]
        ps = meta.page_size
        n = k_cache.shape[0] - 1  # drop the pool's null slot (the torch backend's padding target)
        kv = (k_cache[:n].view(-1, ps, *k_cache.shape[1:]), v_cache[:n].view(-1, ps, *v_cache.shape[1:]))
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if meta.has_decode:
            out[:nd] = self.decode.run(q[:nd], kv)
        if meta.has_extend:
            out[nd:] = self.prefill.run(q[nd:], kv)
        return out
