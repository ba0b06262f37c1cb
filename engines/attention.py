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


class TorchBackend(AttentionBackend):
    """SDPA over K/V gathered from the pool. Decodes run as one padded batch; each extend runs
    alone, so a long prefill never pads the decodes (and vice versa)."""

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
        return TorchMeta(layout.slot_mapping, nd, decode_slots, decode_mask, extends)

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMeta):
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            bd, max_kv = meta.decode_slots.shape
            flat = meta.decode_slots.view(-1)  # index_select: far cheaper than advanced indexing on CPU
            kd = k_cache.index_select(0, flat).view(bd, max_kv, *k_cache.shape[1:]).transpose(1, 2)  # [Bd, Hkv, max_kv, D]
            vd = v_cache.index_select(0, flat).view(bd, max_kv, *v_cache.shape[1:]).transpose(1, 2)
            qd = q[:nd].unsqueeze(2)  # [Bd, H, 1, D]
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, enable_gqa=True)
            out[:nd] = o.squeeze(2)
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
    """`torch` everywhere; GPU kernels are chosen by device, never by a successful import."""
    name = name or "torch"
    if name == "torch":
        return TorchBackend()
    raise ValueError(f"unknown attention backend {name!r} for device {device}; available: torch")
