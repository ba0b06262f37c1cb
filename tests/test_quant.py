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

from engines import Engine, EngineConfig, cpu_kernels
from engines.quant import (
    CONFIG_KEY,
    INT4_AMX_MAX_ROWS,
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
    pack_int4_bf16dot,
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
    if M > lin.kernel_rows and lin.many_rows is not None:  # these rows run the AMX kernel or the bf16
        wq = wq.to(COMPUTE_DTYPE).float()  # copy: the same weight, rounded to bf16 (neither on AVX2-only CPUs)
    a = x.to(COMPUTE_DTYPE).float()
    out = lin(x)
    assert out.shape == (M, N) and out.dtype == torch.float32
    _assert_matches(out, a @ wq.t(), a, wq)


def _unpack_bf16dot(codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """The AMX kernel's decode, lane by lane in plain torch (its layout as documented in
    pack_int4_bf16dot, written out independently) -> w [N, K] fp32, before the bf16 rounding."""
    NB, P, _ = codes.shape
    N, K = NB * 16, 2 * P
    w = torch.empty(N, K)
    sc = scales.float()  # [NB, G, 4, 16]: d_lo, d_hi, z_lo, z_hi per lane
    for b in range(NB):
        for p in range(P):
            g = (2 * p) // group
            for i in range(16):
                byte = int(codes[b, p, i])
                for half, q in ((0, byte & 0xF), (1, byte >> 4)):
                    n, k = 16 * b + 8 * half + i // 2, 2 * p + i % 2
                    w[n, k] = (q - 8) * sc[b, g, half, i] + sc[b, g, 2 + half, i]
    return w


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 3), st.sampled_from([32, 64]), st.integers(1, 2), st.integers(0, 2**31 - 1))
def test_amx_packing_holds_every_code_and_scale_where_the_kernel_reads_them(n16, group, k_groups, seed):
    """Runs on every CPU: the layout is plain tensors."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16 * n16, group * k_groups, generator=g) * 0.05
    q, scale, zero = quantize_int4(w, group)
    codes, scales = pack_int4_bf16dot(q, scale, zero)
    assert codes.dtype == torch.uint8 and scales.dtype == COMPUTE_DTYPE
    ref = dequantize_int4(q, scale.to(COMPUTE_DTYPE), zero.to(COMPUTE_DTYPE))
    assert torch.equal(_unpack_bf16dot(codes, scales, group), ref)


def test_amx_packing_refuses_shapes_it_cannot_lay_out():
    q = torch.zeros(24, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="N % 16 == 0"):
        pack_int4_bf16dot(q, torch.ones(24, 2), torch.zeros(24, 2))


def test_int4_layers_take_the_amx_kernel_exactly_where_the_cpu_has_it():
    lin = QuantLinear(torch.randn(32, 64), None, "int4")
    amx = cpu_kernels.int4_amx_available()
    assert (lin.many_rows == "amx") == amx
    assert lin.kernel_rows == (INT4_AMX_MAX_ROWS if amx else INT4_MAX_ROWS)
    if not amx:  # then the packing the AMX kernel reads is not kept
        assert lin.codes is None and lin.block_scales is None


needs_amx = pytest.mark.skipif(not cpu_kernels.int4_amx_available(),
                               reason="needs a CPU with AMX-BF16 (the kernel is not built or cannot run here)")


@needs_amx
@pytest.mark.parametrize("M", [3, 95, 96, 97, 200])
def test_amx_kernel_over_many_row_passes_and_bf16_input(M):
    """Past 96 rows the kernel makes several passes over the weights; bf16 input skips its cast."""
    g = torch.Generator().manual_seed(M)
    N, K = 48, 192
    w = torch.randn(N, K, generator=g) * 0.05
    x = torch.randn(M, K, generator=g)
    q, scale, zero = quantize_int4(w, 64)
    codes, scales = pack_int4_bf16dot(q, scale, zero)
    wq = dequantize_int4(q, scale.to(COMPUTE_DTYPE), zero.to(COMPUTE_DTYPE)).to(COMPUTE_DTYPE).float()
    a = x.to(COMPUTE_DTYPE).float()
    out = torch.ops.aiorouter_cpu.int4_linear(x, codes, scales, 64)
    assert out.shape == (M, N) and out.dtype == torch.float32
    _assert_matches(out, a @ wq.t(), a, wq)
    assert torch.equal(torch.ops.aiorouter_cpu.int4_linear(x.to(COMPUTE_DTYPE), codes, scales, 64), out)


@needs_amx
def test_amx_kernel_names_what_is_wrong_with_its_input():
    q, scale, zero = quantize_int4(torch.randn(32, 64), 32)
    codes, scales = pack_int4_bf16dot(q, scale, zero)
    op = torch.ops.aiorouter_cpu.int4_linear
    with pytest.raises(RuntimeError, match="codes are for K = 64, x has K = 32"):
        op(torch.randn(4, 32), codes, scales, 32)
    with pytest.raises(RuntimeError, match=r"scales must be contiguous \[2, 1, 4, 16\]"):
        op(torch.randn(4, 64), codes, scales, 64)
    with pytest.raises(RuntimeError, match="x must be fp32 or bf16"):
        op(torch.randn(4, 64, dtype=torch.float64), codes, scales, 32)


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
    # and within int8's worst case of the dense product: each x and w entry is off by at most half
    # its step (xs, s), so an output is off by at most the bound below. (A norm-relative bound
    # fails where the dot product cancels: M = N = 1, K = 16 once read 0.028 against 0.7 * 0.02.)
    dense = x @ w.t()
    ex, ew = xs / 2, s / 2  # [M, 1], [N]
    bound = ex * w.abs().sum(1) + ew * x.abs().sum(1, keepdim=True) + ex * ew * K + 1e-5
    assert ((out - dense).abs() <= bound).all()


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
