"""engines/moe.py against transformers' Qwen3-MoE / Qwen2-MoE sparse blocks (tiny random models)."""
from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file

from engines.config import ModelConfig
from engines.model import MLP
from engines.moe import SparseMoeBlock, hf_param_slice
from engines.quant import QuantLinear, quantize_model
from engines.quant_formats import COMPUTE_DTYPE, dequantize_int4, quantize_int4, quantize_int8

T, HIDDEN, EXPERTS, TOP_K, MOE_I, SHARED_I = 37, 64, 8, 2, 32, 48
PREFIX = "model.layers.0.mlp."


def hf_model(family: str, norm: bool, **extra) -> transformers.PreTrainedModel:
    kw = dict(hidden_size=HIDDEN, moe_intermediate_size=MOE_I, intermediate_size=96, num_experts=EXPERTS,
              num_experts_per_tok=TOP_K, num_hidden_layers=2, vocab_size=512, num_attention_heads=4,
              num_key_value_heads=2, norm_topk_prob=norm, experts_implementation="eager")
    kw.update(extra)
    if family == "qwen2_moe":
        kw.setdefault("shared_expert_intermediate_size", SHARED_I)
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**kw))
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kw))


def load_block(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> SparseMoeBlock:
    """A block filled from layer 0's tensors through hf_param_slice, each parameter covered exactly once."""
    s = cfg.shared_expert_intermediate_size
    with torch.device("meta"):
        block = SparseMoeBlock(cfg, MLP(cfg, s) if s else None)  # as engines.model builds it
    block = block.to_empty(device="cpu")
    params = dict(block.named_parameters())
    covered = dict.fromkeys(params, 0)
    for hf_name, t in tensors.items():
        if not hf_name.startswith(PREFIX):
            continue
        hit = hf_param_slice(hf_name, cfg)
        assert hit is not None, hf_name
        name, index = hit
        assert name.startswith(PREFIX)
        dst = params[name.removeprefix(PREFIX)].data[index]
        assert dst.shape == t.shape, hf_name
        dst.copy_(t)
        covered[name.removeprefix(PREFIX)] += dst.numel()
    assert covered == {n: p.numel() for n, p in params.items()}
    return block


def sizes(norm: bool, shared: int = SHARED_I) -> SimpleNamespace:
    """The engines.moe.MoeSizes a block reads (engines.config.ModelConfig has them too)."""
    return SimpleNamespace(hidden_size=HIDDEN, moe_intermediate_size=MOE_I, num_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, norm_topk_prob=norm, shared_expert_intermediate_size=shared)


def block_of(cfg: SimpleNamespace) -> SparseMoeBlock:
    """A random block with its shared expert (an engines.model MLP) when cfg has one."""
    s = cfg.shared_expert_intermediate_size
    mlp_cfg = SimpleNamespace(hidden_size=cfg.hidden_size, intermediate_size=s, mlp_bias=False, hidden_act="silu")
    return SparseMoeBlock(cfg, MLP(mlp_cfg, s) if s else None)


def rows() -> torch.Tensor:
    return torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(1))  # [T, H]


def assert_diverse_routing(block: SparseMoeBlock, x: torch.Tensor) -> None:
    ids = block.route(x)[1]  # [T, k]
    assert len(ids.unique()) >= 4
    assert len({tuple(sorted(r)) for r in ids.tolist()}) > 1


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
@pytest.mark.parametrize("norm", [False, True], ids=["raw", "norm_topk"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_matches_hf_from_state_dict(family: str, norm: bool, grouped: bool) -> None:
    torch.manual_seed(0)
    model = hf_model(family, norm).eval()
    sd = model.state_dict()
    assert PREFIX + "experts.gate_up_proj" in sd  # transformers 5's fused runtime names
    cfg = ModelConfig.from_dict(model.config.to_dict())
    assert cfg.norm_topk_prob is norm and cfg.num_experts == EXPERTS
    assert cfg.shared_expert_intermediate_size == (SHARED_I if family == "qwen2_moe" else 0)
    block = load_block(sd, cfg)
    assert (block.shared_expert is not None) == (family == "qwen2_moe")
    x = rows()
    assert_diverse_routing(block, x)
    with torch.no_grad():
        ref = model.model.layers[0].mlp(x[None])[0]  # [T, H]
        out = block(x, grouped=grouped)
    assert out.shape == (T, HIDDEN)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_saved_checkpoint_names(family: str, tmp_path) -> None:
    """save_pretrained writes one tensor per expert projection; they load through the same mapping."""
    torch.manual_seed(2)
    model = hf_model(family, norm=True).eval()
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    mlp = sorted(k.removeprefix(PREFIX) for k in tensors if k.startswith(PREFIX))
    want = {"gate.weight", *(f"experts.{e}.{w}_proj.weight" for e in range(EXPERTS) for w in ("gate", "up", "down"))}
    if family == "qwen2_moe":
        want |= {"shared_expert_gate.weight", *(f"shared_expert.{w}_proj.weight" for w in ("gate", "up", "down"))}
    assert set(mlp) == want
    cfg = ModelConfig.from_dict(json.loads((tmp_path / "config.json").read_text()))
    block = load_block(tensors, cfg)
    x = rows()
    with torch.no_grad():
        ref = model.model.layers[0].mlp(x[None])[0]
        for grouped in (False, True):
            torch.testing.assert_close(block(x, grouped=grouped), ref, atol=1e-5, rtol=1e-5)


def test_config_from_hf_json() -> None:
    q3 = transformers.Qwen3MoeConfig(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                                     decoder_sparse_step=2, mlp_only_layers=[0], num_hidden_layers=4).to_dict()
    assert "num_experts" not in q3 and q3["num_local_experts"] == 16  # how transformers 5.25 saves it
    cfg = ModelConfig.from_dict(q3)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (16, 4, True)
    assert cfg.moe_layers == (False, True, False, True) and cfg.shared_expert_intermediate_size == 0
    q2 = ModelConfig.from_dict({"model_type": "qwen2_moe", "hidden_size": 2048, "num_attention_heads": 16,
                                "num_experts": 60, "shared_expert_intermediate_size": 5632,
                                "moe_intermediate_size": 1408})
    assert (q2.num_experts, q2.shared_expert_intermediate_size, q2.num_experts_per_tok) == (60, 5632, 4)
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not implemented for an MoE"):
        ModelConfig.from_dict({**q3, "hidden_act": "gelu"})


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_is_moe_layer_matches_hf(family: str) -> None:
    with torch.device("meta"):
        model = hf_model(family, False, num_hidden_layers=7, decoder_sparse_step=2, mlp_only_layers=[3])
    cfg = ModelConfig.from_dict(model.config.to_dict())
    hf = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers]
    assert hf == [cfg.is_moe(i) for i in range(7)] == [False, True, False, False, False, True, False]


def test_names_outside_the_block() -> None:
    cfg = sizes(False)
    for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.post_attention_layernorm.weight", "lm_head.weight"):
        assert hf_param_slice(name, cfg) is None
    assert hf_param_slice("layers.5.mlp.experts.7.up_proj.weight", cfg) == \
        ("layers.5.mlp.experts.gate_up_proj", (7, slice(MOE_I, 2 * MOE_I)))
    assert hf_param_slice("layers.5.mlp.shared_expert.gate_proj.weight", cfg) == \
        ("layers.5.mlp.shared_expert.gate_up_proj.weight", (slice(0, SHARED_I),))


def test_meta_construction() -> None:
    cfg = sizes(True)
    with torch.device("meta"):
        block = block_of(cfg)
    assert all(p.is_meta for p in block.parameters())
    block = block.to(torch.bfloat16).to_empty(device="cpu")
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in block.named_parameters()}
    assert shapes == {
        "gate.weight": ((EXPERTS, HIDDEN), torch.bfloat16),
        "experts.gate_up_proj": ((EXPERTS, 2 * MOE_I, HIDDEN), torch.bfloat16),
        "experts.down_proj": ((EXPERTS, HIDDEN, MOE_I), torch.bfloat16),
        "shared_expert.gate_up_proj.weight": ((2 * SHARED_I, HIDDEN), torch.bfloat16),
        "shared_expert.down_proj.weight": ((HIDDEN, SHARED_I), torch.bfloat16),
        "shared_expert_gate.weight": ((1, HIDDEN), torch.bfloat16),
    }


def test_bf16_grouped_matches_loop_and_default_is_loop_on_cpu() -> None:
    torch.manual_seed(3)
    block = block_of(sizes(True)).to(torch.bfloat16)
    x = rows().to(torch.bfloat16)
    assert_diverse_routing(block, x)
    with torch.no_grad():
        loop, grouped = block(x, grouped=False), block(x, grouped=True)
        assert torch.equal(block(x), loop)
    assert loop.abs().max() > 0
    torch.testing.assert_close(grouped, loop, atol=2e-3, rtol=2e-2)


def test_packed_shared_expert_keeps_output() -> None:
    torch.manual_seed(4)
    block = block_of(sizes(False)).eval()
    x = rows()
    with torch.no_grad():
        before = block(x)
        # torch's CPU builds carry oneDNN: the shared expert, a model MLP, packs like every MLP
        assert block.shared_expert.gate_up_proj.pack() and block.shared_expert.down_proj.pack()
        assert block.shared_expert.down_proj.weight is None
        torch.testing.assert_close(block(x), before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_the_model_builds_its_sparse_layers_from_config_json(family: str) -> None:
    """engines.model's DecoderLayer: a SparseMoeBlock exactly where transformers has one, with
    transformers' parameter shapes (qwen2_moe's shared expert and its gate included)."""
    from engines.model import CausalLM
    with torch.device("meta"):
        hf = hf_model(family, True, num_hidden_layers=4, decoder_sparse_step=2)
    cfg = ModelConfig.from_dict(hf.config.to_dict())
    with torch.device("meta"):
        ours = CausalLM(cfg)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.layers] == \
        [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers] == [False, True, False, True]
    theirs = {n: tuple(p.shape) for n, p in hf.model.layers[1].mlp.named_parameters()}
    mine = {n: tuple(p.shape) for n, p in ours.layers[1].mlp.named_parameters()}
    assert mine["experts.gate_up_proj"] == theirs["experts.gate_up_proj"] and mine["gate.weight"] == theirs["gate.weight"]
    assert ("shared_expert_gate.weight" in mine) == ("shared_expert_gate.weight" in theirs) == (family == "qwen2_moe")


def on_grid(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """w [N, K] rounded onto the scheme's grid, in float32: what its kernels compute with."""
    if scheme == "int8":
        q, s = quantize_int8(w)
        return q.float() * s.float()[:, None]
    q, scale, zero = quantize_int4(w)
    return dequantize_int4(q, scale.to(COMPUTE_DTYPE), zero.to(COMPUTE_DTYPE))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_experts(scheme: str) -> None:
    """quantize_model reaches the stacked experts: one QuantLinear per expert and projection, no
    dense expert weight left, the router dense, and the output that of the dense block with its
    expert weights on the scheme's grid (up to the kernels' bf16 activations)."""
    torch.manual_seed(5)
    block = block_of(sizes(True, shared=0)).eval()
    x = rows()
    assert_diverse_routing(block, x)
    reference = copy.deepcopy(block)
    with torch.no_grad():
        for stacked in (reference.experts.gate_up_proj, reference.experts.down_proj):
            stacked.copy_(torch.stack([on_grid(w, scheme) for w in stacked]))
        expected, dense = reference(x), block(x)
        n = quantize_model(block, scheme)
        assert n == 2 * EXPERTS
        assert {name for name, _ in block.named_parameters()} == {"gate.weight"}
        assert all(isinstance(m, QuantLinear) and m.method == scheme for pair in block.experts.quantized for m in pair)
        got = block(x)
    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()
    # the kernels round activations to bf16 (~0.4 % here); the grid itself moves the output 1 % (int8)
    # and 13 % (int4) from the dense block's, so a dense expert left behind could not pass
    assert rel(got, expected) < 8e-3 < rel(dense, expected), (rel(got, expected), rel(dense, expected))
