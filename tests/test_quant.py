"""Weight-only quantization (engines/quant.py): each kernel against its de-quantized reference,
the formats' round trips and CUDA layouts, and whole engines quantized against fp32."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import make_tiny_qwen3
from hypothesis import given, settings
from hypothesis import strategies as st

from engines import Engine, EngineConfig
from engines.quant import (
    CONFIG_KEY,
    INT4_MAX_ROWS,
    QuantLinear,
    check_quantization,
    declared_quantization,
)
from engines.quant_formats import (
    COMPUTE_DTYPE,
    check_shape,
    dequantize_int4,
    int4_cuda_bytes,
    int4_inner_k_tiles,
    quantize_int4,
    quantize_int8,
)

CPU = torch.device("cpu")


def _grid_weight(N: int, K: int, group: int, g: torch.Generator) -> torch.Tensor:
    """A weight on a Q4_1 grid (q * d + min per group), like one de-quantized from a GGUF."""
    q = torch.randint(0, 16, (N, K // group, group), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # Q4_1's quantizer maps each group's min to 0 and max to 15
    d = torch.rand(N, K // group, 1, generator=g) * 0.02 + 1e-3
    lo = torch.randn(N, K // group, 1, generator=g) * 0.05 - 7.5 * d
    return (q * d + lo).reshape(N, K)


def _assert_matches(out: torch.Tensor, ref: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> None:
    # out is rounded once to bf16 (2^-8 relative); the rest is fp32 summation order, bounded by
    # K * eps * |a| |w| per element
    bound = 2.0 ** -8 * ref.abs() + 1e-5 * (a.abs() @ w.abs().t()) + 1e-6
    assert ((out.float() - ref).abs() <= bound).all(), (out.float() - ref).abs().max()


shapes = st.tuples(st.integers(0, 40), st.integers(1, 6), st.sampled_from([32, 64, 128]), st.integers(1, 3))


@settings(max_examples=30, deadline=None)
@given(shapes, st.integers(0, 2**31 - 1))
def test_int4_kernel_matches_its_dequantized_weight(shape, seed):
    M, n16, group, k_groups = shape
    g = torch.Generator().manual_seed(seed)
    N, K = 16 * n16, group * k_groups
    w = torch.randn(N, K, generator=g) * 0.05
    lin = QuantLinear(w, None, "int4", group)
    x = torch.randn(M, K, generator=g)
    q, scale, zero = quantize_int4(w, group)
    wq = dequantize_int4(q, scale.to(COMPUTE_DTYPE), zero.to(COMPUTE_DTYPE))  # the scales the kernel reads
    if M > INT4_MAX_ROWS and lin.wide is not None:  # these rows run the layer's bf16 copy: the same
        wq = wq.to(COMPUTE_DTYPE).float()  # weight, rounded to bf16 (absent without oneDNN bf16: AVX2-only CPUs)
    a = x.to(COMPUTE_DTYPE).float()
    out = lin(x)
    assert out.shape == (M, N) and out.dtype == torch.float32
    _assert_matches(out, a @ wq.t(), a, wq)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 40), st.integers(1, 100), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_int8_kernel_matches_its_dequantized_weight(M, N, k16, seed):
    g = torch.Generator().manual_seed(seed)
    K = 16 * k16
    w = torch.randn(N, K, generator=g)
    bias = torch.randn(N, generator=g)
    lin = QuantLinear(w, bias, "int8")
    x = torch.randn(M, K, generator=g)
    q, s = quantize_int8(w)
    wq = q.float() * s.to(COMPUTE_DTYPE).float()[:, None]
    a = x.to(COMPUTE_DTYPE).float()
    _assert_matches(lin(x) - bias, a @ wq.t(), a, wq)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 40), st.integers(1, 100), st.integers(1, 90), st.integers(0, 2**31 - 1))
def test_w8a8_is_the_exact_integer_product_rescaled(M, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g) * 3
    q, s = quantize_int8(w)
    xs = x.abs().amax(-1, keepdim=True) / 127  # per-token scales, written out independently
    xq = (x / xs).round()
    ref = (xq.double() @ q.double().t()) * xs.double() * s.double()
    out = QuantLinear(w, None, "w8a8")(x)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # and it is a close int8 approximation of the dense product
    dense = x @ w.t()
    if M:
        assert (out - dense).norm() <= 0.02 * dense.norm() + 1e-4


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.sampled_from([32, 64, 128, 256]), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_int4_recovers_a_q4_1_grid_exactly(n, group, k_groups, seed):
    w = _grid_weight(n, group * k_groups, group, torch.Generator().manual_seed(seed))
    q, scale, zero = quantize_int4(w, group)
    assert q.min() >= 0 and q.max() <= 15
    torch.testing.assert_close(dequantize_int4(q, scale, zero), w, rtol=0, atol=1e-6)


def test_constant_groups_quantize_exactly():
    w = torch.zeros(16, 64)
    w[3] = 0.25
    q, scale, zero = quantize_int4(w, 32)
    assert torch.equal(dequantize_int4(q, scale, zero), w)
    q8, s8 = quantize_int8(w)
    assert torch.equal(q8.float() * s8[:, None], w)


def test_cuda_layout_helpers():
    q = torch.tensor([[1, 2, 3, 4, 15, 0, 7, 8]])
    assert int4_cuda_bytes(q).tolist() == [[0x12, 0x34, 0xF0, 0x78]]
    assert int4_cuda_bytes(q).dtype == torch.uint8
    assert [int4_inner_k_tiles(k) for k in (32, 64, 96, 128, 576, 1536)] == [2, 4, 2, 8, 4, 8]
    with pytest.raises(ValueError, match="in_features % 32"):
        int4_inner_k_tiles(48)


def test_shapes_a_kernel_cannot_take_are_refused_before_the_kernel_runs():
    with pytest.raises(ValueError, match="out_features % 16"):
        QuantLinear(torch.randn(40, 64), None, "int4")
    with pytest.raises(ValueError, match="in_features % 32"):
        QuantLinear(torch.randn(64, 48), None, "int4")
    with pytest.raises(ValueError, match="group_size"):
        QuantLinear(torch.randn(64, 64), None, "int4", group_size=16)
    with pytest.raises(ValueError, match="in_features % 16"):  # the CPU kernel would segfault on it
        QuantLinear(torch.randn(64, 40), None, "int8")
    with pytest.raises(ValueError, match="one thread per output"):
        check_shape("int8", 64, 64, torch.device("cuda"))
    check_shape("int4", 8, 32, torch.device("cuda"))  # CUDA tiles N by 8


def _engine(path, quantization: str | None = None) -> Engine:
    return Engine(path, config=EngineConfig(quantization=quantization), load_tokenizer=False)


def test_unknown_quantization_names_the_choices():
    assert check_quantization(None) is None and check_quantization("int4") == "int4"
    with pytest.raises(ValueError, match="unknown quantization 'int3'; use one of int4, int8"):
        check_quantization("int3")
    with pytest.raises(ValueError, match="EngineConfig.quantization must be one of int4, int8 or None, got 'int3'"):
        EngineConfig(quantization="int3")


def test_a_model_the_kernels_cannot_take_names_its_layer(tmp_path):
    path = make_tiny_qwen3(tmp_path / "m", hidden=40, heads=4, kv_heads=2)
    with pytest.raises(ValueError, match=r"cannot quantize layers\.0\.self_attn\.qkv_proj .* to int4"):
        _engine(path, "int4")


def test_a_quantized_layer_refuses_to_move():
    lin = QuantLinear(torch.randn(32, 64), None, "int4")
    with pytest.raises(ValueError, match="packed for cpu"):
        lin.to("meta")
    with pytest.raises(ValueError, match="cannot be moved or cast"):
        lin.float()  # would turn the bf16 scales into fp32, which the kernel refuses


def _embedding_and_norms(eng: Engine) -> int:
    c = eng.model_config
    norms = c.num_hidden_layers * (2 * c.hidden_size + (2 * c.head_dim if c.qk_norm else 0)) + c.hidden_size
    return c.vocab_size * c.hidden_size + norms


def _greedy(eng: Engine, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    return [o.token_ids for o in eng.generate(prompts, max_tokens=n, temperature=0.0, ignore_eos=True)]


def _logits(eng: Engine, prompts: list[list[int]]) -> torch.Tensor:
    seqs = [eng.add_request(p) for p in prompts]
    out = eng.forward()
    for s in seqs:
        eng.abort(s)
    order = {s.seq_id: i for i, s in enumerate(seqs)}
    return out.logits[torch.tensor([order[s.seq_id] for s in out.seqs]).argsort()]  # prompt order


@pytest.mark.parametrize("scheme,tie", [("int4", False), ("int4", True), ("int8", False)])
def test_quantized_engine_tracks_fp32(tmp_path, scheme, tie):
    path = make_tiny_qwen3(tmp_path / "m", hidden=128, layers=2, heads=4, kv_heads=2, vocab=512, tie=tie)
    if scheme == "int4":  # put the weights on a Q4_1 grid, as a GGUF source would
        from safetensors.torch import load_file, save_file
        f = next(path.glob("*.safetensors"))
        sd = load_file(str(f))
        for k, v in sd.items():
            if v.ndim == 2 and "embed" not in k and "lm_head" not in k:
                q, s, z = quantize_int4(v, 32)
                sd[k] = dequantize_int4(q, s, z).contiguous()
        save_file(sd, str(f), metadata={"format": "pt"})
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 9, 17, 3)]
    dense, quant = _engine(path), _engine(path, scheme)
    # every linear layer, the head included, left the parameters: the embedding and norms remain
    assert quant.num_params == _embedding_and_norms(dense)
    ref, got = _logits(dense, prompts), _logits(quant, prompts)
    assert not torch.equal(got, ref)
    assert (got - ref).norm() <= 0.03 * ref.norm()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
    a, b = _greedy(dense, prompts), _greedy(quant, prompts)
    same = sum(x == y for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    assert same >= 0.75 * sum(map(len, a)), (a, b)


def test_checkpoint_can_ask_to_be_loaded_quantized(tmp_path, tiny_qwen3):
    path = tmp_path / "q"
    shutil.copytree(tiny_qwen3, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, CONFIG_KEY: "int8"}))
    assert declared_quantization(path) == "int8" and declared_quantization(tiny_qwen3) is None
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    declared, int8, int4 = _logits(_engine(path), prompts), _logits(_engine(tiny_qwen3, "int8"), prompts), \
        _logits(_engine(tiny_qwen3, "int4"), prompts)
    assert torch.equal(declared, int8) and not torch.equal(declared, _logits(_engine(tiny_qwen3), prompts))
    assert torch.equal(_logits(_engine(path, "int4"), prompts), int4)  # an explicit argument wins
    (path / "config.json").write_text(json.dumps({**cfg, CONFIG_KEY: "fp3"}))
    with pytest.raises(ValueError, match=f"{CONFIG_KEY}: unknown quantization 'fp3'"):
        _engine(path)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 16, 33])
def test_int4_cuda_kernel_matches_its_dequantized_weight(M):
    g = torch.Generator().manual_seed(M)
    w = torch.randn(96, 576, generator=g) * 0.05
    x = torch.randn(M, 576, generator=g)
    lin = QuantLinear(w.cuda(), None, "int4")
    q, scale, zero = quantize_int4(w, 32)
    wq = dequantize_int4(q, scale.to(COMPUTE_DTYPE), zero.to(COMPUTE_DTYPE))
    a = x.to(COMPUTE_DTYPE).float()
    _assert_matches(lin(x.cuda()).cpu(), a @ wq.t(), a, wq)
