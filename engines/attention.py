"""Attention backends over the paged KV pool.

The engine lays a step out as `BatchLayout` (decodes first, then extends) once; a backend
turns it into its own metadata with `plan` once per step, and `forward` is called per layer.
The torch backend runs anywhere (it is the CPU path and the reference); the flashinfer and
Triton backends (CUDA) plug in behind the same two calls. A backend whose `graph_safe` is True
returns plan metadata that a captured CUDA graph can take by copy (engines/cuda_graph.py).
"""
from __future__ import annotations

import os
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
    host_block_tables: list[list[int]] | None = None  # the same, unpadded, for planners on the host


class AttentionBackend(ABC):
    graph_safe = False  # plan -> NamedTuple of fixed-shape tensors and ints, forward syncs nothing
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
    extends: list[_Extend]
    memo: dict  # filled by the first layer, reused by the rest: gather rows per Hkv, masks per dtype


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


class TorchBackend(AttentionBackend):
    """SDPA over K/V gathered from the pool. Decodes run as a few padded batches grouped by
    length; each extend runs alone, so a long prefill never pads the decodes (and vice versa).

    Decode K/V are gathered head-major ([n, Hkv, max_kv, D] per group, contiguous) into two
    scratch buffers the backend keeps across layers and steps: SDPA on the transposed
    slot-major gather takes a slow strided path in bf16 (15 ms vs 3 ms per layer at Bd=32,
    kv=527), and a fresh multi-MB tensor per layer costs more in page faults than the copy
    itself (measured: two 13 MB gathers 11.7 ms into new memory, 1.2 ms into reused buffers).
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
        return TorchMeta(layout.slot_mapping, nd, decode_slots, groups, extends, {})

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMeta):
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        T, h, d = q.shape
        nd = meta.num_decodes
        out = None
        if nd:
            hkv = k_cache.shape[1]
            rows = meta.memo.get(hkv)
            if rows is None:  # once per step: rows (slot * Hkv + head) of the cache seen as [slots * Hkv, D]
                heads = torch.arange(hkv, device=q.device)
                null_slot = k_cache.shape[0] - 1  # KVPool's zeroed extra slot
                rows, off = [], 0
                for g in meta.decode_groups:  # slots [n * max_kv] -> rows head-major [n, Hkv, max_kv]
                    n_kv = (g.end - g.start) * g.max_kv
                    sl = meta.decode_slots[off:off + n_kv].view(-1, 1, g.max_kv)
                    sl = torch.where(sl < 0, null_slot, sl)
                    rows.append((sl * hkv + heads[None, :, None]).view(-1))
                    off += n_kv
                rows = meta.memo[hkv] = torch.cat(rows) if len(rows) > 1 else rows[0]
            n = rows.numel()
            # index_select(out=): far cheaper than advanced indexing on CPU, and no fresh memory
            kd = torch.index_select(k_cache.view(-1, d), 0, rows, out=self._buffer(0, n * d, k_cache).view(n, d))
            vd = torch.index_select(v_cache.view(-1, d), 0, rows, out=self._buffer(1, n * d, v_cache).view(n, d))
            if len(meta.decode_groups) > 1 or nd < T:
                out = torch.empty(T, h, d, dtype=q.dtype, device=q.device)
            off = 0
            for i, g in enumerate(meta.decode_groups):
                b, size = g.end - g.start, (g.end - g.start) * hkv * g.max_kv
                kg = kd[off:off + size].view(b, hkv, g.max_kv, d)
                vg = vd[off:off + size].view(b, hkv, g.max_kv, d)
                off += size
                # q_len is 1, so the G query heads sharing a KV head can stand in as G query rows:
                # plain SDPA on [n, Hkv, G, D] (HF's GQA order: query head j*G + g uses KV head j).
                qg = q[g.start:g.end].view(b, hkv, h // hkv, d)
                mask = g.mask
                if mask is not None:  # made additive once per step (SDPA would convert it per call)
                    key = ("mask", i, q.dtype)
                    if key not in meta.memo:
                        meta.memo[key] = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                            ~mask, float("-inf"))
                    mask = meta.memo[key]
                o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask)  # [n, Hkv, G, D]
                if out is None:
                    return o.view(b, h, d)  # one group, decodes only: nothing else to place
                out[g.start:g.end] = o.view(b, h, d)
        if out is None:
            out = torch.empty(T, h, d, dtype=q.dtype, device=q.device)
        run_extends(q, k, v, k_cache, v_cache, meta.extends, out)
        return out

def plan_extend(layout: BatchLayout, i: int, q0: int) -> _Extend:
    """Sequence i of the layout, whose query rows start at q0, as an SDPA extend."""
    ps, bt, dev = layout.page_size, layout.block_tables, layout.slot_mapping.device
    q_len, kv_len = layout.q_lens[i], layout.kv_lens[i]
    prefix = kv_len - q_len
    if prefix == 0:
        return _Extend(q0, q0 + q_len, None, None)
    pos = torch.arange(kv_len, device=dev)
    slots = bt[i, pos // ps] * ps + pos % ps
    mask = pos[None, :] <= (prefix + torch.arange(q_len, device=dev))[:, None]
    return _Extend(q0, q0 + q_len, slots, mask)


def run_extends(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, extends: list[_Extend], out: torch.Tensor) -> None:
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


BACKENDS = ("flashinfer", "triton", "torch")  # preference order on CUDA; CPU: "cpu", else "torch"


def select_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """Pick by device, never by a successful import: flashinfer and triton import on CPU machines
    but none of their kernels run there. On CUDA the first installed of BACKENDS; on CPU the
    kernel backend (engines/cpu_attention.py) when it builds, else torch. `name` forces one
    ("torch" works everywhere, "cpu" on CPU, the others need CUDA; "triton" also runs on CPU under the
    Triton interpreter, TRITON_INTERPRET=1, which only tests and dry runs want)."""
    device = torch.device(device)
    if name is None:
        name = "torch"
        if device.type == "cuda" and torch.cuda.is_available():
            name = next(b for b in BACKENDS if b == "torch" or _has(b))
        elif device.type == "cpu":
            from engines import cpu_attention
            op = cpu_attention.load()  # None (and one warning) when the kernel cannot be built here
            return cpu_attention.CpuBackend(op) if op is not None else TorchBackend()
    if name == "torch":
        return TorchBackend()
    if name == "cpu":
        from engines import cpu_attention
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on CPU tensors only, got {device}")
        op = cpu_attention.load()
        if op is None:
            raise RuntimeError("attention backend 'cpu': its kernel could not be built here (see the warning above)")
        return cpu_attention.CpuBackend(op)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: torch, cpu (CPU kernel), "
                         "triton (CUDA), flashinfer (CUDA)")
    interpreted = name == "triton" and os.environ.get("TRITON_INTERPRET") == "1"  # CPU tests, dry runs
    if device.type != "cuda" and not interpreted:
        raise ValueError(f"attention backend {name!r} needs a CUDA device, got {device}")
    if name == "triton":
        from engines.triton_backend import TritonBackend
        return TritonBackend()
    from engines.flashinfer_backend import FlashInferBackend
    return FlashInferBackend(device)


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None
