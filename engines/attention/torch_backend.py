"""The portable attention backend: SDPA over K/V gathered from the pool. It runs anywhere and is
the reference the other backends are tested against."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from engines.attention.base import FULL, AttentionBackend, BatchLayout, LayerAttn
from engines.attention.sdpa import Extend, plan_extend, run_extends, run_layer_extends, softcap_attention


class _DecodeGroup(NamedTuple):
    """Decodes q[start:end] (rows of q), padded to one context length."""
    start: int
    end: int
    max_kv: int
    mask: torch.Tensor | None  # [n, 1, 1, max_kv] bool (True = attend), None when no row is padded


class TorchMeta(NamedTuple):
    slot_mapping: torch.Tensor  # [T]
    num_decodes: int
    decode_slots: torch.Tensor | None  # [sum over groups of n * max_kv] int64, group after group
    decode_groups: list[_DecodeGroup]
    extends: list[Extend]
    memo: dict  # filled by the first layer, reused by the rest: gather rows per Hkv, masks per dtype
    decode_lens: list[int]  # context length per decode, for windowed layers' own gathers
    block_tables: torch.Tensor  # [B, max_pages] int64
    page_size: int


# Decodes padded to the longest context in the batch waste ~40% of the gather and SDPA work
# when prompts range over 20..400 tokens. With decodes sorted longest first (the runner sorts
# them), a new group starts where the context is at most _SPLIT_RATIO of the group's longest and
# the padding it avoids (in tokens, for all the rest) is at least _MIN_SAVED: a group costs ~3
# small ops per layer, a padded token ~0.15 us per layer. Measured at Bd=32, 1 thread: 5 groups
# make a decode step 13% (fp32) to 17% (bf16) faster than one padded batch.
_SPLIT_RATIO, _MIN_SAVED = 0.75, 256


def _group_decodes(lens: list[int]) -> list[tuple[int, int]]:
    """Context lengths of the decodes -> [start, end) ranges that share one padded length.
    Any order is correct; longest-first order makes the groups tight."""
    groups, start, top = [], 0, lens[0]
    for i in range(1, len(lens)):
        if lens[i] <= _SPLIT_RATIO * top and (len(lens) - i) * (top - lens[i]) >= _MIN_SAVED:
            groups.append((start, i))
            start = i
            top = lens[i]
        top = max(top, lens[i])
    groups.append((start, len(lens)))
    return groups


def _window_decodes(meta: TorchMeta, window: int) -> tuple[int, torch.Tensor | None, list[_DecodeGroup]]:
    """The decodes' gather for a layer that sees only the last `window` keys: each decode reads
    positions [kv_len - window, kv_len), so a 512-token window over 4k contexts gathers and scores
    512 keys, not 4k. -> (window, slots, groups) in plan's format, or (0, plan's slots, plan's
    groups) when no decode's context exceeds the window."""
    lens = meta.decode_lens
    seen = [min(n, window) for n in lens]
    if seen == lens:
        return 0, meta.decode_slots, meta.decode_groups
    bt, ps, dev = meta.block_tables, meta.page_size, meta.slot_mapping.device
    slots, groups = [], []
    for a, b in _group_decodes(seen):  # longest first stays longest first: min(n, window) keeps the order
        width = max(seen[a:b])
        j = torch.arange(width, device=dev)
        first = torch.tensor([n - s for n, s in zip(lens[a:b], seen[a:b])], device=dev)  # [n] first visible position
        valid = j[None, :] < torch.tensor(seen[a:b], device=dev)[:, None]  # [n, width]
        pos = torch.where(valid, first[:, None] + j[None, :], 0)
        sl = bt[a:b].gather(1, pos // ps) * ps + pos % ps  # [n, width]
        mask = None
        if min(seen[a:b]) != width:
            sl = sl.masked_fill(~valid, -1)  # padding: the pool's zeroed null slot, as in plan
            mask = valid[:, None, None, :]
        slots.append(sl.view(-1))
        groups.append(_DecodeGroup(a, b, width, mask))
    return window, (torch.cat(slots) if len(slots) > 1 else slots[0]), groups


class TorchBackend(AttentionBackend):
    """SDPA over K/V gathered from the pool. Decodes run as a few padded batches grouped by
    length; each extend runs alone, so a long prefill never pads the decodes (and vice versa).

    Decode K/V are gathered head-major ([n, Hkv, max_kv, D] per group, contiguous) into two
    scratch buffers the backend keeps across layers and steps: SDPA on the transposed
    slot-major gather takes a slow strided path in bf16 (15 ms vs 3 ms per layer at Bd=32,
    kv=527), and a fresh multi-MB tensor per layer costs more in page faults than the copy
    itself (measured: two 13 MB gathers 11.7 ms into new memory, 1.2 ms into reused buffers).

    A windowed layer's decodes gather only their windows (their own rows, once per step and
    window): 16 decodes at context 4k (H 8, Hkv 2, D 64, fp32, 1 thread) take 25 ms per layer call
    in full and 3.7 ms with a 512 window. A softcapped layer's scores go through
    `sdpa.softcap_attention`, which SDPA cannot do (same case: 32 ms).
    """

    def __init__(self) -> None:
        self._scratch: list[torch.Tensor | None] = [None, None]  # K, V decode gathers (flat)

    def _buffer(self, i: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat scratch tensor of `numel` elements, reused while it fits. 25% headroom: contexts
        grow a token per step and the buffer should not; shrunk when 4x too big, so a burst of
        long contexts does not pin its memory for good."""
        buf = self._scratch[i]
        if (buf is None or not numel <= buf.numel() <= 4 * numel + 4096 or buf.dtype != like.dtype
                or buf.device != like.device):
            buf = torch.empty(numel + numel // 4, dtype=like.dtype, device=like.device)
            self._scratch[i] = buf
        return buf[:numel]

    def plan(self, layout: BatchLayout) -> TorchMeta:
        ps, bt, dev = layout.page_size, layout.block_tables, layout.slot_mapping.device
        nd = layout.num_decodes
        decode_slots, groups = None, []
        if nd:
            lens, slots = layout.kv_lens[:nd], []
            for a, b in _group_decodes(lens):
                max_kv = max(lens[a:b])
                pos = torch.arange(max_kv, device=dev)
                sl = bt[a:b, pos // ps] * ps + pos % ps  # [n, max_kv]
                mask = None
                if min(lens[a:b]) != max_kv:
                    valid = pos[None, :] < torch.tensor(lens[a:b], device=dev)[:, None]
                    sl = sl.masked_fill(~valid, -1)  # padding: read the pool's zeroed null slot
                    mask = valid[:, None, None, :]
                slots.append(sl.view(-1))  # [n * max_kv]
                groups.append(_DecodeGroup(a, b, max_kv, mask))
            decode_slots = torch.cat(slots) if len(slots) > 1 else slots[0]
        extends, q0 = [], nd
        for i in range(nd, len(layout.q_lens)):
            extends.append(plan_extend(layout, i, q0))
            q0 += layout.q_lens[i]
        return TorchMeta(layout.slot_mapping, nd, decode_slots, groups, extends, {}, layout.kv_lens[:nd],
                         bt, ps)

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMeta, layer: LayerAttn = FULL):
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        T, h, d = q.shape
        nd = meta.num_decodes
        out = None
        if nd:
            hkv = k_cache.shape[1]
            window, slots, groups = 0, meta.decode_slots, meta.decode_groups
            if layer.window > 0:  # its own gather, once per step and window
                win = meta.memo.get(("window", layer.window))
                if win is None:
                    win = meta.memo[("window", layer.window)] = _window_decodes(meta, layer.window)
                window, slots, groups = win
            rows_key = hkv if window == 0 else (hkv, window)
            rows = meta.memo.get(rows_key)
            if rows is None:  # once per step: rows (slot * Hkv + head) of the cache seen as [slots * Hkv, D]
                heads = torch.arange(hkv, device=q.device)
                null_slot = k_cache.shape[0] - 1  # KVPool's zeroed extra slot
                rows, off = [], 0
                for g in groups:  # slots [n * max_kv] -> rows head-major [n, Hkv, max_kv]
                    n_kv = (g.end - g.start) * g.max_kv
                    sl = slots[off:off + n_kv].view(-1, 1, g.max_kv)
                    sl = torch.where(sl < 0, null_slot, sl)
                    rows.append((sl * hkv + heads[None, :, None]).view(-1))
                    off += n_kv
                rows = meta.memo[rows_key] = torch.cat(rows) if len(rows) > 1 else rows[0]
            n = rows.numel()
            # index_select(out=): far cheaper than advanced indexing on CPU, and no fresh memory
            kd = torch.index_select(k_cache.view(-1, d), 0, rows, out=self._buffer(0, n * d, k_cache).view(n, d))
            vd = torch.index_select(v_cache.view(-1, d), 0, rows, out=self._buffer(1, n * d, v_cache).view(n, d))
            if len(groups) > 1 or nd < T:
                out = torch.empty(T, h, d, dtype=q.dtype, device=q.device)
            off = 0
            for i, g in enumerate(groups):
                b, size = g.end - g.start, (g.end - g.start) * hkv * g.max_kv
                kg = kd[off:off + size].view(b, hkv, g.max_kv, d)
                vg = vd[off:off + size].view(b, hkv, g.max_kv, d)
                off += size
                # q_len is 1, so the G query heads sharing a KV head can stand in as G query rows:
                # plain SDPA on [n, Hkv, G, D] (HF's GQA order: query head j*G + g uses KV head j).
                qg = q[g.start:g.end].view(b, hkv, h // hkv, d)
                mask = g.mask
                if mask is not None:  # made additive once per step (SDPA would convert it per call)
                    key = ("mask", window, i, q.dtype)
                    if key not in meta.memo:
                        meta.memo[key] = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                            ~mask, float("-inf"))
                    mask = meta.memo[key]
                if layer.softcap > 0:
                    scale = layer.scale if layer.scale is not None else d ** -0.5
                    o = softcap_attention(qg, kg, vg, mask, scale, layer.softcap)  # [n, Hkv, G, D]
                else:
                    o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=layer.scale)  # [n, Hkv, G, D]
                if out is None:
                    return o.view(b, h, d)  # one group, decodes only: nothing else to place
                out[g.start:g.end] = o.view(b, h, d)
        if out is None:
            out = torch.empty(T, h, d, dtype=q.dtype, device=q.device)
        if layer == FULL:
            run_extends(q, k, v, k_cache, v_cache, meta.extends, out)
        else:
            run_layer_extends(q, k, v, k_cache, v_cache, meta.extends, out, layer, meta.memo)
        return out
