"""The fused CPU RMSNorm kernels (engines/csrc/rms_norm_cpu.cpp) against torch's formula, and a
model run through them against the same model on torch ops."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from engines import cpu_kernels
from engines.config import ModelConfig
from engines.model import CausalLM, RMSNorm

OPS = cpu_kernels.load()
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}


def test_kernels_build():
    assert OPS is not None, "the CPU kernels did not build (needs g++ and ninja)"


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), heads=st.integers(1, 5), d=st.sampled_from([8, 64, 100, 576, 1024]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), strided=st.booleans(), seed=st.integers(0, 999))
def test_rms_norm_matches_torch(rows, heads, d, dtype, strided, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d, generator=g).to(dtype)
    base = torch.randn(rows, 2 * heads + 1, d, generator=g).to(dtype)
    # the q heads of a [T, H + 2 Hkv, D] qkv view, as the model normalises them in place; or plain rows
    x = base[:, :heads] if strided else base[:, 0].contiguous()
    ref = F.rms_norm(x.float(), (d,), w.float(), 1e-6)
    out = torch.empty(x.shape, dtype=dtype)
    OPS.rms_norm(x, w, 1e-6, out)
    assert torch.allclose(out.float(), ref, rtol=TOL[dtype], atol=TOL[dtype])
    rest = base[:, heads:].clone()
    OPS.rms_norm(x, w, 1e-6, x)  # in place (out aliases x)
    assert torch.equal(x, out)
    assert torch.equal(base[:, heads:], rest)  # the neighbouring heads are untouched


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 70), d=st.sampled_from([16, 256, 576, 1024]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 999))
def test_add_rms_norm_matches_add_then_norm(rows, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x, res = (torch.randn(rows, d, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(d, generator=g).to(dtype)
    want_res = res + x  # the torch add, rounded to dtype
    want = F.rms_norm(want_res.float(), (d,), w.float(), 1e-5)
    OPS.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(res, want_res)
    assert torch.allclose(x.float(), want, rtol=TOL[dtype], atol=TOL[dtype])


def test_bad_shapes_name_the_problem():
    x, w = torch.randn(3, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match=r"weight must be \[8\]"):
        OPS.rms_norm(x, torch.randn(7), 1e-6, torch.empty(3, 8))
    with pytest.raises(RuntimeError, match="contiguous"):
        OPS.rms_norm(torch.randn(8, 3).t(), w[:3].contiguous(), 1e-6, torch.empty(3, 8))
    with pytest.raises(RuntimeError, match="dtypes differ"):
        OPS.rms_norm(x, w.double(), 1e-6, torch.empty(3, 8))
    with pytest.raises(RuntimeError, match="same shape|contiguous"):
        OPS.add_rms_norm(x, torch.randn(4, 8), w, 1e-6)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_model_on_fused_kernels_matches_torch_ops(qk_norm):
    """The whole forward (residual adds folded into the norms, q/k normed in place) against the
    same weights on torch ops: same hidden states to fp32 rounding."""
    cfg = ModelConfig(model_type="qwen3", vocab_size=97, max_position_embeddings=64, attention_bias=False,
                      mlp_bias=False, eos_token_ids=(1,), bos_token_id=0, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=10000.0, qk_norm=qk_norm, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = CausalLM(cfg).eval()
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.weight.data.uniform_(0.5, 1.5)
    from engines.attention import BatchLayout
    from engines.attention.torch_backend import TorchBackend
    from engines.kv_cache import KVPool
    from engines.model import AttnContext, rope_cache, signed_sin
    T = 7
    ids, pos = torch.randint(0, 97, (T,)), torch.arange(T)
    (cos, sin), = rope_cache(cfg, 32, torch.device("cpu"))  # one rope
    cos, sin = (cos[pos][:, None],), (signed_sin(sin)[pos][:, None],)
    outs = []
    for ops in (None, OPS):
        model.use_cpu_kernels(ops)
        pool = KVPool(cfg, 4, 4, torch.float32, torch.device("cpu"))
        layout = BatchLayout(0, [T], [T], torch.arange(T), torch.tensor([[0, 1]]), 4)
        be = TorchBackend()
        with torch.inference_mode():
            outs.append(model(ids, AttnContext(be, be.plan(layout), pool, cos, sin)))
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert not torch.equal(outs[0], torch.zeros_like(outs[0]))
