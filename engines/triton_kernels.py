"""Paged attention in Triton: a KV store, a decode kernel (GQA heads packed per program) and an
extend kernel (causal over cached prefix + new tokens). All read the pool through block tables.

Verified only under the Triton interpreter on CPU tensors (tests/test_triton_kernels.py). The
interpreter computes bf16 as raw uint16, so `UPCAST` (set for CPU tensors and fp32 pools) loads
K/V/Q as fp32 before every dot; the GPU bf16 path (bf16 `tl.dot`, fp32 accumulation) has not run.

Per layer (engines/attention/base.py LayerAttn), as constexpr switches so a FULL layer compiles to
the same kernel as before: WINDOWED (keys p - window < t <= p; key blocks wholly older than a
tile's first window are skipped, and keys older than it are not even loaded), SOFTCAP (scores ->
softcap * tanh(scores / softcap)); the scale is a plain argument. All three are host scalars fixed
per layer, so a CUDA graph captures each layer's launches with its own.

CPU tensors run only with TRITON_INTERPRET=1 set before triton is first imported (tests/conftest.py
does that on machines without CUDA): triton decorates its own standard library at import.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv(K, V, KC, VC, slot_mapping, stride_kt, stride_vt, stride_ct,
              N: tl.constexpr, BLOCK: tl.constexpr):
    """One program per token: k/v [T, Hkv*D] -> caches [slots, Hkv*D]; slot < 0 writes nothing
    (CUDA-graph padding, where index_copy_ would need a valid target)."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot >= 0:
        for start in range(0, N, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < N
            tl.store(KC + slot * stride_ct + offs, tl.load(K + t * stride_kt + offs, mask=m), mask=m)
            tl.store(VC + slot * stride_ct + offs, tl.load(V + t * stride_vt + offs, mask=m), mask=m)


@triton.jit
def _tanh(x):
    """tanh from exp2 (the interpreter has no libdevice tanh): exact to ~1e-7 absolute, and no
    overflow, since the exponent is never positive."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # e^(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scales(scale, softcap, SOFTCAP: tl.constexpr):
    """-> (factor on q.k, factor after tanh): exp2-domain scores are tanh(q.k * a) * b with a
    softcap, q.k * a without one (b unused)."""
    if SOFTCAP:
        return scale / softcap, softcap * 1.4426950408889634
    else:
        return scale * 1.4426950408889634, 1.0


@triton.jit
def _attend_block(q, m_i, l_i, acc, KC, VC, bt_row, start, kv_len, kvh, qpos, offs_d, stride_ct, stride_ch,
                  qk_scale, dmask, lo, window, cap, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr,
                  WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N) of a sequence whose pages are
    bt_row[...]: q [M, BLOCK_D] (M query rows of one KV head kvh) -> updated (m_i, l_i, acc).
    CAUSAL: key position <= qpos[row]; otherwise every key < kv_len counts (decode). WINDOWED:
    keys before `lo` (the first any row sees) are not loaded, and with CAUSAL a row sees keys
    > qpos[row] - window only (a decode's rows share one position: `lo` is its whole window).
    SOFTCAP: scores are tanh(q.k * qk_scale) * cap (see _scales)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    nmask = offs_n < kv_len
    if WINDOWED:
        nmask = nmask & (offs_n >= lo)
    page = tl.load(bt_row + offs_n // PAGE, mask=nmask, other=0)
    slot = page.to(tl.int64) * PAGE + offs_n % PAGE  # int64: slot * stride overflows int32 on big pools
    kv_off = slot[:, None] * stride_ct + kvh * stride_ch + offs_d[None, :]
    kvmask = nmask[:, None] & dmask[None, :]
    k = tl.load(KC + kv_off, mask=kvmask, other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(VC + kv_off, mask=kvmask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, BLOCK_N]
    if SOFTCAP:
        s = _tanh(s) * cap
    keep = nmask[None, :]
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= qpos[:, None])
        if WINDOWED:
            keep = keep & (offs_n[None, :] > qpos[:, None] - window)
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that sees no key yet (an extend row past q_len) stays finite; it is never stored
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode(Q, KC, VC, O, block_tables, kv_lens, scale, window, softcap,
            stride_qt, stride_qh, stride_ct, stride_ch, stride_ot, stride_oh, stride_bt,
            PAGE: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    """Grid (B, Hkv): sequence b, KV head h attends its G query heads over kv_lens[b] cached tokens.
    G query heads are one [BLOCK_G, D] tile so K/V are read once per KV head (BLOCK_G >= 16 for
    tl.dot). kv_len 0 (a padded row) writes zeros."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_len = tl.load(kv_lens + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    gmask = offs_g < G
    dmask = offs_d < D
    q = tl.load(Q + b * stride_qt + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    qk_scale, cap = _scales(scale, softcap, SOFTCAP)  # exp2 domain
    lo = 0
    if WINDOWED:
        lo = tl.maximum(kv_len - window, 0)  # the decode sees the keys [kv_len - window, kv_len)
    for start in range((lo // BLOCK_N) * BLOCK_N, kv_len, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, KC, VC, block_tables + b * stride_bt, start, kv_len, h,
                                      offs_d, offs_d, stride_ct, stride_ch, qk_scale, dmask, lo, window, cap, PAGE,
                                      BLOCK_N, UPCAST, PRECISION, False, WINDOWED, SOFTCAP)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + b * stride_ot + (h * G + offs_g)[:, None] * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _extend(Q, KC, VC, O, block_tables, kv_lens, qo_indptr, work_seq, work_mblk, scale, window, softcap,
            stride_qt, stride_qh, stride_ct, stride_ch, stride_ot, stride_oh, stride_bt,
            PAGE: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    """Grid (W, H): work item w is query block work_mblk[w] of sequence work_seq[w] (-1: padding,
    nothing to do), query head h. Its q_len new tokens sit at the end of its kv_len context and
    their K/V are already in the pool, so every key comes through the block table; causal mask
    key_pos <= prefix + query index."""
    w = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(work_seq + w)
    if b >= 0:
        mblk = tl.load(work_mblk + w)
        q0 = tl.load(qo_indptr + b)
        q_len = tl.load(qo_indptr + b + 1) - q0
        kv_len = tl.load(kv_lens + b)
        prefix = kv_len - q_len
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mmask = offs_m < q_len
        dmask = offs_d < D
        q = tl.load(Q + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=mmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        if UPCAST:
            q = q.to(tl.float32)
        qpos = prefix + offs_m
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        qk_scale, cap = _scales(scale, softcap, SOFTCAP)
        kvh = h // G
        end = tl.minimum(kv_len, prefix + (mblk + 1) * BLOCK_M)  # keys past the block's last query are masked anyway
        lo = 0
        if WINDOWED:
            lo = tl.maximum(prefix + mblk * BLOCK_M - window + 1, 0)  # the first key the block's first query sees
        for start in range((lo // BLOCK_N) * BLOCK_N, end, BLOCK_N):
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, KC, VC, block_tables + b * stride_bt, start, kv_len, kvh,
                                          qpos, offs_d, stride_ct, stride_ch, qk_scale, dmask, lo, window, cap, PAGE,
                                          BLOCK_N, UPCAST, PRECISION, True, WINDOWED, SOFTCAP)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(O + (q0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def _interp(t: torch.Tensor) -> bool:
    """True for CPU tensors, which only the interpreter can run."""
    if t.device.type == "cuda":
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"Triton kernels got {t.device} tensors: they run on CUDA, or on CPU under the "
                           "interpreter (TRITON_INTERPRET=1 set before triton is imported)")
    return True


def _precision(t: torch.Tensor) -> str:
    # fp32 pools: tl.dot would round to tf32 (10-bit mantissa) on Ampere+; bf16/fp16 ignore this
    return "ieee" if t.dtype == torch.float32 else "tf32"


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v [T, Hkv, D] -> k_cache/v_cache [slots, Hkv, D] at slot_mapping [T] (-1: skip)."""
    T = k.shape[0]
    if T == 0:
        return
    n = k.shape[1] * k.shape[2]
    k, v = k.reshape(T, n), v.reshape(T, n)  # a view for the usual contiguous heads
    _interp(k)
    _store_kv[(T,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                        k_cache.stride(0), N=n, BLOCK=min(1024, triton.next_power_of_2(n)))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 block_tables: torch.Tensor, kv_lens: torch.Tensor, page_size: int, scale: float,
                 block_n: int = 64, window: int = 0, softcap: float = 0.0) -> None:
    """q [B, H, D] (one token per sequence) -> out [B, H, D] over kv_lens [B] cached tokens, or
    the last `window` of them (0: all); softcap 0: none."""
    B, H, D = q.shape
    hkv = k_cache.shape[1]
    if B == 0:
        return
    G = H // hkv
    _decode[(B, hkv)](
        q, k_cache, v_cache, out, block_tables, kv_lens, scale, window, softcap,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), PAGE=page_size, G=G, D=D, BLOCK_G=max(16, triton.next_power_of_2(G)),
        BLOCK_D=triton.next_power_of_2(D), BLOCK_N=block_n, UPCAST=_interp(q) or q.dtype == torch.float32,
        PRECISION=_precision(q), WINDOWED=window > 0, SOFTCAP=softcap > 0)


def paged_extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 block_tables: torch.Tensor, kv_lens: torch.Tensor, qo_indptr: torch.Tensor,
                 work_seq: torch.Tensor, work_mblk: torch.Tensor, page_size: int, scale: float,
                 block_m: int, block_n: int = 64, window: int = 0, softcap: float = 0.0) -> None:
    """q [T, H, D] -> out [T, H, D] for the work items (work_seq/work_mblk [W]) that `extend_work`
    made; window 0: causal over every key; softcap 0: none."""
    H, D = q.shape[1], q.shape[2]
    W = work_seq.shape[0]
    if W == 0:
        return
    _extend[(W, H)](
        q, k_cache, v_cache, out, block_tables, kv_lens, qo_indptr, work_seq, work_mblk, scale, window, softcap,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), PAGE=page_size, G=H // k_cache.shape[1], D=D, BLOCK_M=block_m,
        BLOCK_D=triton.next_power_of_2(D), BLOCK_N=block_n, UPCAST=_interp(q) or q.dtype == torch.float32,
        PRECISION=_precision(q), WINDOWED=window > 0, SOFTCAP=softcap > 0)


def extend_work(q_lens: list[int], first: int, block_m: int, num_tokens: int) -> tuple[list[int], list[int]]:
    """Query blocks of sequences first.. as (work_seq, work_mblk), padded with seq -1 to the bound
    len(q_lens[first:]) + num_tokens // block_m, which depends on shapes only (so a CUDA graph
    captured for those shapes fits any batch of them). q_len 0 (a padded row) has no block."""
    seqs, blks = [], []
    for b in range(first, len(q_lens)):
        for m in range(-(-q_lens[b] // block_m)):
            seqs.append(b)
            blks.append(m)
    bound = len(q_lens) - first + num_tokens // block_m
    assert len(seqs) <= bound, (len(seqs), bound)
    pad = bound - len(seqs)
    return seqs + [-1] * pad, blks + [0] * pad
