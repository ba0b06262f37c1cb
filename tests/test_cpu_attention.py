"""The CPU paged-attention kernel (engines/attention/cpu_backend.py) against TorchBackend, the reference.

Ragged steps mix decodes, short extends (the kernel's, e.g. handoff resumes) and long ones
(SDPA's), over GQA ratios, page sizes and head dims with and without a compiled-in fast path;
batches small enough that the kernel splits work by KV head and large enough that it does not.
The engine picks this backend on CPU and still matches HF token for token (test_engine_parity)."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attn_cases import random_step
from engines.attention import select_backend
from engines.attention.torch_backend import TorchBackend
from engines.attention.cpu_backend import KERNEL_MAX_Q, CpuBackend, load

OP = load()


def test_kernel_builds_and_is_the_cpu_default():
    assert OP is not None, "the CPU attention kernel did not build (needs g++ and ninja)"
    assert isinstance(select_backend(torch.device("cpu")), CpuBackend)
    assert isinstance(select_backend(torch.device("cpu"), "torch"), TorchBackend)


def _both(layout, kc, vc, g, h, hkv, d, dtype):
    T = sum(layout.q_lens)
    q = torch.randn(T, h + hkv, d, generator=g).to(dtype)[:, :h]  # strided rows, as in the model
    k = torch.randn(T, hkv, d, generator=g).to(dtype)
    v = torch.randn(T, hkv, d, generator=g).to(dtype)
    outs = []
    for backend in (TorchBackend(), CpuBackend(OP)):
        kc2, vc2 = kc.clone(), vc.clone()
        outs.append((backend.forward(q, k, v, kc2, vc2, backend.plan(layout)), kc2, vc2))
    return outs


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), shape=st.sampled_from([(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 48), (16, 8, 64)]),
       ps=st.sampled_from([1, 4, 16]), nd=st.integers(0, 9), ne=st.integers(0, 3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_kernel_matches_torch_backend(seed, shape, ps, nd, ne, dtype):
    if nd + ne == 0:
        nd = 1
    h, hkv, d = shape
    layout, kc, vc, g = random_step(random.Random(seed), nd, ne, ps, hkv, d, dtype)
    (ref, rk, rv), (out, ok, ov) = _both(layout, kc, vc, g, h, hkv, d, dtype)
    assert torch.equal(rk, ok) and torch.equal(rv, ov)  # both wrote this step's K/V to the same slots
    # fp32: summation order only. bf16: the reference's SDPA rounds its softmax and output to
    # bf16 on the way; the kernel stays in fp32 until the end, so ~2 bf16 ulps on O(1) values.
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_short_extends_go_to_the_kernel_and_long_ones_to_sdpa():
    rng = random.Random(7)
    layout, kc, vc, g = random_step(rng, 3, 6, 16, 3, 64, torch.float32)
    meta = CpuBackend(OP).plan(layout)
    short = [i for i, q in enumerate(layout.q_lens) if q <= KERNEL_MAX_Q]
    assert meta.seqs[:, 0].tolist() == short
    assert len(meta.extends) == len(layout.q_lens) - len(short)
    assert meta.seqs[:, 2].tolist() == [layout.q_lens[i] for i in short]
    assert meta.seqs[:, 3].tolist() == [layout.kv_lens[i] for i in short]


def test_kernel_rejects_mismatched_inputs():
    q = torch.randn(2, 4, 16)
    kc = torch.randn(9, 2, 16, dtype=torch.bfloat16)
    seqs = torch.tensor([[0, 0, 1, 3], [1, 1, 1, 2]])
    bt = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="share a dtype"):
        OP(q, kc, kc, bt, seqs, 4, 0.25, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        OP(q[:, :3], kc.float()[:, :2], kc.float()[:, :2], bt, seqs, 4, 0.25, torch.empty(2, 3, 16))


@pytest.mark.parametrize("shape", [(16, 4, 64), (8, 2, 128), (9, 3, 64), (4, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_row_extends_match_torch_backend(shape, dtype):
    """Short extends with many query rows per KV head (handoff resumes under GQA: q_len * G up
    to 64, so up to 4 blocks of 16 rows in the kernel's AVX-512 path) next to decodes."""
    h, hkv, d = shape
    for seed in range(6):
        layout, kc, vc, g = random_step(random.Random(seed), 2, 5, 4, hkv, d, dtype, max_ctx=300)
        # every extend short enough for the kernel, at least 2 tokens, with a cached prefix
        q_lens = [1] * 2 + [min(KERNEL_MAX_Q, max(2, kv // 3)) for kv in layout.kv_lens[2:]]
        slots = []
        for q, kv, table in zip(q_lens, layout.kv_lens, layout.block_tables.tolist()):
            slots += [table[t // 4] * 4 + t % 4 for t in range(kv - q, kv)]
        layout = layout._replace(q_lens=q_lens, slot_mapping=torch.tensor(slots, dtype=torch.int64))
        assert any(q * (h // hkv) >= 8 for q in q_lens[2:])
        (ref, rk, rv), (out, ok, ov) = _both(layout, kc, vc, g, h, hkv, d, dtype)
        assert torch.equal(rk, ok) and torch.equal(rv, ov)
        tol = 2e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
