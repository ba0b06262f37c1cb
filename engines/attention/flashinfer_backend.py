"""flashinfer attention on CUDA: the paged prefill wrapper (causal) for extends, the paged decode
wrapper for decodes, one workspace per model, `plan` once per step and kind of layer (base.LayerAttn:
its window, scale and softcap go to flashinfer's plan as window_left, sm_scale, logits_soft_cap).

Not exercised on the CPU machines this project is developed on: it runs only where a GPU is
lent (bench/gpu/check.py); `select_backend` never picks it for a CPU device. It is not
graph-safe (its wrappers plan into their own buffers), so the runner replays small steps with
the Triton backend's graphs instead; both read the same pool.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from engines.attention.base import FULL, AttentionBackend, BatchLayout, LayerAttn
from engines.paged_meta import build_paged_meta


class FlashInferMeta(NamedTuple):
    slot_mapping: torch.Tensor  # [T]
    num_decode_tokens: int
    has_decode: bool
    has_extend: bool
    page_size: int
    decode_args: tuple | None  # host int32 (kv_indptr, kv_indices, kv_last_page_len) for the decode plans
    prefill_args: tuple | None  # host int32 (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
    planned: set  # the layer kinds (LayerAttn) whose wrappers hold this step's plan
    used: set  # the layer kinds this step ran, planned up front next step


def window_left(window: int) -> int:
    """LayerAttn.window -> flashinfer's window_left. flashinfer keeps key j for the query at
    position p when j >= p - window_left (its LogitsMask: kv_idx + qo_len + window_left >=
    kv_len + qo_idx), i.e. window_left + 1 keys with the query's own; HF's window counts the
    query's own among its `window` keys (j > p - window). -1: no window."""
    return window - 1 if window > 0 else -1


class FlashInferBackend(AttentionBackend):
    """flashinfer bakes a layer's window, scale and softcap into its plan (they pick the kernel
    variant), so each kind of layer (Gemma 3: local and global) gets its own pair of wrappers,
    all on one workspace (they run one after another on one stream), planned once per step: up
    front for the kinds the previous step ran, on first use for any other."""

    def __init__(self, device: torch.device, workspace_bytes: int = 128 * 2**20):
        import flashinfer
        self._flashinfer = flashinfer
        self.device = torch.device(device)
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._wrappers: dict[LayerAttn, tuple] = {FULL: (self.decode, self.prefill)}  # kind -> (decode, prefill)
        self._used: set[LayerAttn] = set()  # the kinds the step planned last ran
        self.shape: tuple[int, int, int] | None = None  # (heads, kv heads, head dim), set by bind
        self.dtype: torch.dtype | None = None

    def bind(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.shape, self.dtype = (num_heads, num_kv_heads, head_dim), dtype

    def plan(self, layout: BatchLayout) -> FlashInferMeta:
        ps, nd = layout.page_size, layout.num_decodes
        # host lists: reading the device block tables back would wait for the stream
        bts = layout.host_block_tables if layout.host_block_tables is not None else layout.block_tables.tolist()
        i32 = dict(dtype=torch.int32)  # host tensors: plan reads indptr on the host and copies the rest up
        decode_args = prefill_args = None
        if nd:
            m = build_paged_meta(layout.q_lens[:nd], layout.kv_lens[:nd], bts[:nd], ps)
            decode_args = (torch.tensor(m.kv_indptr, **i32), torch.tensor(m.kv_indices, **i32),
                           torch.tensor(m.kv_last_page_len, **i32))
        if nd < len(layout.q_lens):
            m = build_paged_meta(layout.q_lens[nd:], layout.kv_lens[nd:], bts[nd:], ps)
            prefill_args = (torch.tensor(m.qo_indptr, **i32), torch.tensor(m.kv_indptr, **i32),
                            torch.tensor(m.kv_indices, **i32), torch.tensor(m.kv_last_page_len, **i32))
        last, self._used = self._used, set()
        meta = FlashInferMeta(layout.slot_mapping, nd, nd > 0, nd < len(layout.q_lens), ps, decode_args,
                              prefill_args, set(), self._used)
        for kind in last or (FULL,):
            self._plan(kind, meta)
        return meta

    def _plan(self, layer: LayerAttn, meta: FlashInferMeta) -> None:
        """Plan this step for one kind of layer, on its own wrappers (made on its first step)."""
        h, hkv, d = self.shape
        wrappers = self._wrappers.get(layer)
        if wrappers is None:
            fi = self._flashinfer
            wrappers = self._wrappers[layer] = (fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD"),
                                                fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD"))
        # None: flashinfer's own defaults (head_dim ** -0.5, no softcap), as before these options existed
        opts = dict(window_left=window_left(layer.window), logits_soft_cap=layer.softcap or None, sm_scale=layer.scale,
                    q_data_type=self.dtype, kv_data_type=self.dtype)
        if meta.decode_args is not None:
            wrappers[0].plan(*meta.decode_args, h, hkv, d, meta.page_size, **opts)
        if meta.prefill_args is not None:
            wrappers[1].plan(*meta.prefill_args, h, hkv, d, meta.page_size, causal=True, **opts)
        meta.planned.add(layer)

    def forward(self, q, k, v, k_cache, v_cache, meta: FlashInferMeta, layer: LayerAttn = FULL):
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        if layer not in meta.planned:
            self._plan(layer, meta)
        meta.used.add(layer)
        decode, prefill = self._wrappers[layer]
        # the pool is [num_slots, Hkv, D]; flashinfer's NHD pages are [num_pages, page_size, Hkv, D]
        ps = meta.page_size
        n = k_cache.shape[0] - 1  # drop the pool's null slot (the torch backend's padding target)
        kv = (k_cache[:n].view(-1, ps, *k_cache.shape[1:]), v_cache[:n].view(-1, ps, *v_cache.shape[1:]))
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if meta.has_decode:
            out[:nd] = decode.run(q[:nd], kv)
        if meta.has_extend:
            out[nd:] = prefill.run(q[nd:], kv)
        return out
