"""Triton paged-attention kernels against TorchBackend, run by the Triton interpreter on CPU.

This checks the kernels' indexing, masking and online softmax (GQA, page sizes, ragged and
padded batches). It does not check the compiled GPU path: the interpreter computes in fp32
(its bf16 is raw uint16), and nothing here measures speed."""
from __future__ import annotations

import random

import pytest
import torch

import triton  # the test extra brings it: a missing install fails here rather than skipping

from engines.attention import BatchLayout  # noqa: E402
from engines.attention.torch_backend import TorchBackend  # noqa: E402
from engines.attention.triton_backend import TritonBackend  # noqa: E402
from engines.triton_kernels import extend_work  # noqa: E402
from attn_cases import random_step  # noqa: E402

pytestmark = pytest.mark.triton_interp


def _run(backend, layout, q, k, v, kc, vc):
    kc, vc = kc.clone(), vc.clone()
    out = backend.forward(q, k, v, kc, vc, backend.plan(layout))
    return out, kc, vc


CASES = [  # (heads, kv heads, head dim, page size, decodes, extends)
    (4, 2, 16, 4, 3, 2),
    (8, 1, 32, 16, 5, 0),
    (4, 4, 16, 1, 0, 3),
    (6, 2, 32, 8, 2, 2),  # G = 3: a non-power-of-two group
    (16, 8, 64, 16, 2, 1),
]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("h,hkv,d,ps,nd,ne", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_triton_matches_torch_backend(h, hkv, d, ps, nd, ne, dtype, device):
    """cpu: the interpreter (fp32 compute); cuda: the compiled kernels (bf16 tl.dot there)."""
    rng = random.Random(hash((h, hkv, d, ps, nd, ne)) & 0xFFFF)
    layout, kc, vc, g = random_step(rng, nd, ne, ps, hkv, d, dtype)
    T = sum(layout.q_lens)
    q = torch.randn(T, h, d, generator=g).to(dtype)
    k = torch.randn(T, hkv, d, generator=g).to(dtype)
    v = torch.randn(T, hkv, d, generator=g).to(dtype)
    if device != "cpu":
        layout = layout._replace(slot_mapping=layout.slot_mapping.to(device), block_tables=layout.block_tables.to(device))
        q, k, v, kc, vc = (t.to(device) for t in (q, k, v, kc, vc))
    ref, rk, rv = _run(TorchBackend(), layout, q, k, v, kc, vc)
    # small blocks so contexts span several key blocks and extends several query blocks
    got, gk, gv = _run(TritonBackend(block_m=16, block_n=16), layout, q, k, v, kc, vc)
    assert torch.equal(gk, rk) and torch.equal(gv, rv)
    # bf16: one rounding of the fp32 result either way (interpreter); on CUDA also bf16 P @ V in the kernel
    tol = (1e-5 if dtype == torch.float32 else 2e-2) if device == "cpu" else (1e-4 if dtype == torch.float32 else 4e-2)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def test_padded_rows_read_and_write_nothing():
    """CUDA-graph padding: extra decode rows (kv_len 0, slot -1) and extra extend rows (q_len 0)
    leave the pool untouched and the real rows' outputs unchanged."""
    rng = random.Random(7)
    h, hkv, d, ps = 4, 2, 16, 4
    layout, kc, vc, g = random_step(rng, 2, 2, ps, hkv, d, torch.float32)
    T = sum(layout.q_lens)
    q, k, v = (torch.randn(T, n, d, generator=g) for n in (h, hkv, hkv))
    ref, rk, rv = _run(TritonBackend(16, 16), layout, q, k, v, kc, vc)
    # pad: 2 decode rows after the real decodes, 1 empty extend row, 3 padding tokens at the end
    nd, ql, kl = layout.num_decodes, layout.q_lens, layout.kv_lens
    bt = layout.block_tables
    zero_rows = torch.zeros(2, bt.shape[1], dtype=bt.dtype)
    pbt = torch.cat([bt[:nd], zero_rows, bt[nd:], zero_rows[:1]])
    dec_slots, ext_slots = layout.slot_mapping[:nd], layout.slot_mapping[nd:]
    minus = torch.full((1,), -1, dtype=torch.int64)
    pslots = torch.cat([dec_slots, minus, minus, ext_slots, minus, minus, minus])
    padded = BatchLayout(nd + 2, ql[:nd] + [1, 1] + ql[nd:] + [0], kl[:nd] + [0, 0] + kl[nd:] + [0], pslots, pbt, ps)

    def pad(x):  # padding tokens carry garbage: it must not reach anything
        junk = torch.full((1, *x.shape[1:]), 1e4)
        return torch.cat([x[:nd], junk, junk, x[nd:], junk, junk, junk])
    out, pk, pv = _run(TritonBackend(16, 16), padded, pad(q), pad(k), pad(v), kc, vc)
    assert torch.equal(pk, rk) and torch.equal(pv, rv)
    torch.testing.assert_close(out[:nd], ref[:nd], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[nd + 2:nd + 2 + T - nd], ref[nd:], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[nd:nd + 2], torch.zeros(2, h, d))  # empty context: zeros, not NaN


def test_extend_work_bound_depends_on_shapes_only():
    seqs, blks = extend_work([1, 1, 40, 3, 17], first=2, block_m=16, num_tokens=80)  # padded as if 80 tokens
    assert len(seqs) == 3 + 80 // 16
    assert seqs[:6] == [2, 2, 2, 3, 4, 4] and blks[:6] == [0, 1, 2, 0, 0, 1] and set(seqs[6:]) == {-1}
    for _ in range(200):  # the bound holds for any split of the tokens
        rng = random.Random(_)
        q = [rng.randrange(0, 40) for _ in range(rng.randrange(1, 8))]
        bm = rng.choice([1, 4, 16, 32])
        s, _b = extend_work(q, 0, bm, sum(q))
        assert len(s) == len(q) + sum(q) // bm
        assert sum(x >= 0 for x in s) == sum(-(-n // bm) for n in q)
