"""SDPA extends (prefill, chunked prefill, handoff resume) over the paged pool, shared by the torch
and CPU backends: each extend runs alone, so a long prefill never pads anything."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from engines.attention.base import BatchLayout


class Extend(NamedTuple):
    q_start: int
    q_end: int
    kv_slots: torch.Tensor | None  # [kv_len] int64, None when there is no cached prefix
    mask: torch.Tensor | None  # [q_len, kv_len] bool (True = attend), None -> plain causal


def plan_extend(layout: BatchLayout, i: int, q0: int) -> Extend:
    """Sequence i of the layout, whose query rows start at q0, as an SDPA extend."""
    ps, bt, dev = layout.page_size, layout.block_tables, layout.slot_mapping.device
    q_len, kv_len = layout.q_lens[i], layout.kv_lens[i]
    prefix = kv_len - q_len
    if prefix == 0:
        return Extend(q0, q0 + q_len, None, None)
    pos = torch.arange(kv_len, device=dev)
    slots = bt[i, pos // ps] * ps + pos % ps
    mask = pos[None, :] <= (prefix + torch.arange(q_len, device=dev))[:, None]
    return Extend(q0, q0 + q_len, slots, mask)


def run_extends(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, extends: list[Extend], out: torch.Tensor) -> None:
    """SDPA per extend, each alone (a long prefill never pads anything), into out's rows."""
    for e in extends:
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
