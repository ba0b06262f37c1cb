"""Attention backends over the paged KV pool.

The engine lays a step out as `BatchLayout` (decodes first, then extends) once; a backend
turns it into its own metadata with `plan` once per step, and `forward` is called per layer.
The torch backend runs anywhere (it is the CPU path and the reference); a flashinfer
backend plugs in behind the same two calls.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch
import torch.nn.functional as F


class BatchLayout(NamedTuple):
    num_decodes: int  # the first num_decodes sequences compute exactly one token each
    q_lens: list[int]  # tokens computed this step, per sequence
    kv_lens: list[int]  # context length after this step, per sequence
    slot_mapping: torch.Tensor  # [T] int64: pool slot for each new token's K/V
    block_tables: torch.Tensor  # [B, max_pages] int64, padded with 0
    page_size: int


class AttentionBackend(ABC):
    @abstractmethod
    def plan(self, layout: BatchLayout) -> object:
        """Per-step metadata shared by every layer."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: object) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D], caches [num_slots, Hkv, D] -> out [T, H, D].

        Writes this step's k/v into the caches first."""


class _Extend(NamedTuple):
    q_start: int
    q_end: int
    kv_slots: torch.Tensor | None  # [kv_len] int64, None when there is no cached prefix
    mask: torch.Tensor | None  # [q_len, kv_len] bool (True = attend), None -> plain causal


class TorchMeta(NamedTuple):
    slot_mapping: torch.Tensor  # [T]
    num_decodes: int
    decode_slots: torch.Tensor | None  # [Bd, max_kv] int64
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_kv] bool, None when all lengths match
    extends: list[_Extend]
    decode_rows: dict[int, torch.Tensor]  # Hkv -> [Bd * Hkv * max_kv] rows of the cache seen as [slots * Hkv, D]


class TorchBackend(AttentionBackend):
    """SDPA over K/V gathered from the pool. Decodes run as one padded batch; each extend runs
    alone, so a long prefill never pads the decodes (and vice versa).

    Decode K/V are gathered head-major ([Bd, Hkv, max_kv, D], contiguous) into two scratch
    buffers the backend keeps across layers and steps: SDPA on the transposed slot-major
    gather takes a slow strided path in bf16 (15 ms vs 3 ms per layer at Bd=32, kv=527), and a
    fresh multi-MB tensor per layer costs more in page faults than the copy itself (measured:
    two 13 MB gathers 11.7 ms into new memory, 1.2 ms into reused buffers).
    """

    def __init__(self) -> None:
        self._scratch: list[torch.Tensor | None] = [None, None]  # K, V decode gathers (flat)

    def _buffer(self, i: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._scratch[i]
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            # 25% headroom: the context grows a token per step, the buffer should not
            buf = torch.empty(numel + numel // 4, dtype=like.dtype, device=like.device)
            self._scratch[i] = buf
        return buf[:numel]

    def plan(self, layout: BatchLayout) -> TorchMeta:
        ps, bt, dev = layout.page_size, layout.block_tables, layout.slot_mapping.device
        nd = layout.num_decodes
        decode_slots = decode_mask = None
        if nd:
            lens = layout.kv_lens[:nd]
            max_kv = max(lens)
            pos = torch.arange(max_kv, device=dev)
            decode_slots = bt[:nd, pos // ps] * ps + pos % ps  # [Bd, max_kv]
            if min(lens) != max_kv:
                decode_mask = (pos[None, :] < torch.tensor(lens, device=dev)[:, None])[:, None, None, :]
        extends, q0 = [], nd
        for i in range(nd, len(layout.q_lens)):
            q_len, kv_len = layout.q_lens[i], layout.kv_lens[i]
            prefix = kv_len - q_len
            if prefix == 0:
                extends.append(_Extend(q0, q0 + q_len, None, None))
            else:
                pos = torch.arange(kv_len, device=dev)
                slots = bt[i, pos // ps] * ps + pos % ps
                mask = pos[None, :] <= (prefix + torch.arange(q_len, device=dev))[:, None]
                extends.append(_Extend(q0, q0 + q_len, slots, mask))
            q0 += q_len
        return TorchMeta(layout.slot_mapping, nd, decode_slots, decode_mask, extends, {})

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMeta):
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        nd = meta.num_decodes
        out = torch.empty_like(q) if nd < q.shape[0] else None  # [T, H, D] unless decodes only
        if nd:
            bd, max_kv = meta.decode_slots.shape
            _, hkv, d = k_cache.shape
            rows = meta.decode_rows.get(hkv)
            if rows is None:  # once per step: row (slot * Hkv + head) of every K/V vector, head-major
                heads = torch.arange(hkv, device=q.device)
                rows = (meta.decode_slots[:, None, :] * hkv + heads[None, :, None]).view(-1)
                meta.decode_rows[hkv] = rows
            n = rows.numel()
            # index_select(out=): far cheaper than advanced indexing on CPU, and no fresh memory
            kd = torch.index_select(k_cache.view(-1, d), 0, rows, out=self._buffer(0, n * d, k_cache).view(n, d))
            vd = torch.index_select(v_cache.view(-1, d), 0, rows, out=self._buffer(1, n * d, v_cache).view(n, d))
            kd, vd = kd.view(bd, hkv, max_kv, d), vd.view(bd, hkv, max_kv, d)
            # q_len is 1, so the G query heads sharing a KV head can stand in as G query rows:
            # plain SDPA on [Bd, Hkv, G, D] (HF's GQA order: query head j*G + g uses KV head j).
            qd = q[:nd].view(bd, hkv, q.shape[1] // hkv, d)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)  # [Bd, Hkv, G, D]
            if nd == q.shape[0]:
                return o.view(bd, q.shape[1], d)  # a pure decode step: nothing else to place
            out[:nd] = o.view(bd, q.shape[1], d)
        for e in meta.extends:
            qe = q[e.q_start:e.q_end].transpose(0, 1)[None]  # [1, H, q_len, D]
            if e.kv_slots is None:
                ke = k[e.q_start:e.q_end].transpose(0, 1)[None]
                ve = v[e.q_start:e.q_end].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, enable_gqa=True)
            else:
                ke = k_cache.index_select(0, e.kv_slots).transpose(0, 1)[None]  # [1, Hkv, kv_len, D]
                ve = v_cache.index_select(0, e.kv_slots).transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=e.mask[None, None], enable_gqa=True)
            out[e.q_start:e.q_end] = o[0].transpose(0, 1)
        return out


def select_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """Pick by device, never by a successful import: flashinfer imports on CPU machines but
    none of its kernels run there. `name` forces one ("torch" works everywhere)."""
    device = torch.device(device)
    if name is None:
        name = "torch"
        if device.type == "cuda" and torch.cuda.is_available():
            name = "flashinfer" if _has("flashinfer") else "torch"
    if name == "torch":
        return TorchBackend()
    if name not in ("flashinfer",):
        raise ValueError(f"unknown attention backend {name!r}; available: torch, flashinfer (CUDA)")
    if device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device, got {device}")
    if name == "flashinfer":
        from engines.flashinfer_backend import FlashInferBackend
        return FlashInferBackend(device)


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None
