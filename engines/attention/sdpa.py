"""SDPA extends (prefill, chunked prefill, handoff resume) over the paged pool, shared by the torch
and CPU backends: each extend runs alone, so a long prefill never pads anything.

A layer other than FULL (base.LayerAttn) takes `run_layer_extends`: a window becomes a mask (and
trims the keys gathered to those some query can see), a scale goes to SDPA's `scale=`, and a
softcap, which SDPA cannot apply, goes to `softcap_attention`'s explicit scores."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from engines.attention.base import BatchLayout, LayerAttn


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


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """q_pos [Lq], k_pos [Lk] (positions in the sequence) -> [Lq, Lk] bool, True = attend: causal,
    and with window > 0 only the last `window` positions up to the query's own (HF's rule,
    masking_utils.sliding_window_overlay: kv_idx > q_idx - sliding_window)."""
    keep = k_pos[None, :] <= q_pos[:, None]
    if window > 0:
        keep &= k_pos[None, :] > (q_pos - window)[:, None]
    return keep


# Explicit scores for a softcap cost Lq * Lk floats per head; a 4k-token prefill chunk at 8 heads
# would hold 512 MB at once, so queries go in chunks that keep one chunk's scores near this size.
_SOFTCAP_CHUNK_ELEMS = 1 << 24


def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, softcap: float) -> torch.Tensor:
    """softmax(softcap * tanh(scale * q k^T / softcap) + mask) v, in float32, which SDPA cannot do.

    q [..., Lq, D], k/v [..., Lk, D] (leading dims broadcast: GQA callers put the G query heads of a
    KV head in their own dim), mask bool (True = attend) or additive, broadcastable to the scores
    [..., Lq, Lk], or None -> out [..., Lq, D] in q's dtype."""
    kf, vf = k.float().transpose(-1, -2), v.float()
    lq, lk = q.shape[-2], k.shape[-2]
    rows = max(1, _SOFTCAP_CHUNK_ELEMS // max(1, lk * q[..., :1, :1].numel()))
    outs = []
    for r0 in range(0, lq, rows):
        s = torch.matmul(q[..., r0:r0 + rows, :].float(), kf).mul_(scale / softcap).tanh_().mul_(softcap)
        if mask is not None:
            m = mask[..., r0:r0 + rows, :] if mask.shape[-2] != 1 else mask
            s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
        outs.append(torch.matmul(torch.softmax(s, dim=-1), vf))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)).to(q.dtype)


def run_layer_extends(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, extends: list[Extend], out: torch.Tensor, layer: LayerAttn,
                      memo: dict) -> None:
    """`run_extends` for a layer with a window, scale or softcap. A window trims the keys to those
    the extend's first query can still see (a chunked prefill deep into a long context gathers
    window + chunk keys, not the whole context); its masks go into `memo` (per step), keyed by
    extend and window, for the step's other layers with that window."""
    h, hkv, d = q.shape[1], k_cache.shape[1], q.shape[2]
    scale = layer.scale if layer.scale is not None else d ** -0.5
    for e in extends:
        q_len = e.q_end - e.q_start
        kv_len = q_len if e.kv_slots is None else e.kv_slots.shape[0]
        prefix = kv_len - q_len
        lo = max(0, prefix - layer.window + 1) if layer.window > 0 else 0  # first key any query sees
        key = ("extend", e.q_start, layer.window)
        mask = memo.get(key)
        if mask is None and (prefix > 0 or 0 < layer.window < q_len or layer.softcap > 0):  # else: plain causal
            dev = q.device
            mask = memo[key] = window_mask(torch.arange(prefix, kv_len, device=dev),
                                           torch.arange(lo, kv_len, device=dev), layer.window)  # [q_len, kv_len - lo]
        qe = q[e.q_start:e.q_end].transpose(0, 1)[None]  # [1, H, q_len, D]
        if e.kv_slots is None:
            ke = k[e.q_start:e.q_end].transpose(0, 1)[None]  # [1, Hkv, q_len, D]
            ve = v[e.q_start:e.q_end].transpose(0, 1)[None]
        else:
            slots = e.kv_slots[lo:] if lo else e.kv_slots
            ke = k_cache.index_select(0, slots).transpose(0, 1)[None]  # [1, Hkv, kv_len - lo, D]
            ve = v_cache.index_select(0, slots).transpose(0, 1)[None]
        if layer.softcap > 0:
            # query head j * G + g uses KV head j: [1, Hkv, G, q_len, D] against [1, Hkv, 1, kv, D]
            o = softcap_attention(qe.view(1, hkv, h // hkv, q_len, d), ke[:, :, None], ve[:, :, None], mask,
                                  scale, layer.softcap).view(1, h, q_len, d)
        elif mask is None:
            o = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=mask[None, None], scale=scale, enable_gqa=True)
        out[e.q_start:e.q_end] = o[0].transpose(0, 1)
