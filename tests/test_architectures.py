"""Every family the engine serves, on tiny random models transformers builds, against transformers'
own output on the same weights: greedy tokens on prompts longer than the sliding windows (16-32),
and first-step and decode logits to 1e-4 (fp32). Also: config fields the engine does not implement
are refused at load, by name."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from engines import Engine
from engines.config import ModelConfig

NEW = 24
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=384, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
             pad_token_id=0, tie_word_embeddings=False)

# model_type -> config fields beyond SMALL (windows of 16-32 so 40- and 150-token prompts pass them)
ARCHS = {
    "llama_biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "mistral_window": ("mistral", dict(sliding_window=16)),
    "qwen2_window": ("qwen2", dict(use_sliding_window=True, sliding_window=24, max_window_layers=2)),
    "qwen3_window": ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "gemma2": ("gemma2", dict(sliding_window=16, query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
                              final_logit_softcapping=10.0, hidden_activation="gelu_pytorch_tanh")),
    "gemma3_text": ("gemma3_text", dict(sliding_window=32, num_hidden_layers=7, query_pre_attn_scalar=16,
                                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 1e4}})),
    "phi3": ("phi3", dict(pad_token_id=0)),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", dict(embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.4,
                                logits_scaling=2.5)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, decoder_sparse_step=2)),
    "llama_linear_rope": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})),
    "llama_dynamic_rope": ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})),
    "qwen3_yarn_rope": ("qwen3", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                       "original_max_position_embeddings": 128})),
    "phi3_longrope": ("phi3", dict(max_position_embeddings=512, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 256,
        "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.3 * i for i in range(8)]})),
}


def build(tmp_path, name: str, seed: int = 0):
    mt, extra = ARCHS[name]
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(mt, **{**SMALL, **extra})
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # random init leaves norms at one (or zero, gemma): perturb so a norm bug cannot hide
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path / name
    model.save_pretrained(path)
    return path, model


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def check_against_hf(path, hf, backend: str | None = None):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 384, (n,), generator=g).tolist() for n in (10, 40, 150)]
    eng = Engine.from_pretrained(path, num_kv_tokens=2048, attention_backend=backend)
    outs = eng.generate(prompts, max_tokens=NEW, temperature=0.0, ignore_eos=True)  # one batch
    for p, o in zip(prompts, outs):
        with torch.no_grad():  # first-step and last decode logits, HF on the whole context at once
            ctx = p + o.token_ids[:-1]
            ref = hf(torch.tensor([ctx])).logits[0, [len(p) - 1, len(ctx) - 1]].float()
        seq = eng.add_request(p, _forced(len(o.token_ids)))
        got = []
        while not seq.is_finished:
            out = eng.forward()
            for s, t, lg in zip(out.seqs, out.next_tokens, out.logits):
                got.append(lg[:ref.shape[-1]])
                eng.append_token(s, o.token_ids[len(got) - 1])
        got = torch.stack([got[0], got[-1]])
        rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert rel.max().item() < 1e-4, (len(p), rel)
        assert o.token_ids == hf_greedy(hf, p), len(p)
    assert eng.kv_usage().pages_free == eng.kv_usage().pages_total


def _forced(n):
    from engines import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("name", list(ARCHS))
def test_matches_transformers(tmp_path, name):
    path, hf = build(tmp_path, name)
    check_against_hf(path, hf)


@pytest.mark.parametrize("name", ["mistral_window", "gemma3_text", "gemma2"])
def test_windows_on_the_torch_backend(tmp_path, name):
    """The default CPU backend is the paged kernel; the portable torch backend honours windows too."""
    path, hf = build(tmp_path, name)
    check_against_hf(path, hf, backend="torch")


@pytest.mark.triton_interp
@pytest.mark.parametrize("name", ["gemma3_text", "gemma2"])
def test_windows_on_the_triton_backend(tmp_path, name):
    """The GPU kernels' windows, scale and soft-cap, run by Triton's interpreter on CPU."""
    path, hf = build(tmp_path, name)
    check_against_hf(path, hf, backend="triton")


def test_config_reads_what_transformers_derives(tmp_path):
    """Windows and rope tables per layer as transformers lays them out."""
    path, _ = build(tmp_path, "gemma3_text")
    cfg = ModelConfig.from_dir(path)
    assert cfg.layer_windows == (32, 32, 32, 32, 32, 0, 32)  # 5 local : 1 global
    assert cfg.layer_ropes[5] != cfg.layer_ropes[0] and len(cfg.ropes) == 2
    path, _ = build(tmp_path, "qwen2_window")
    assert ModelConfig.from_dir(path).layer_windows == (0, 0, 24, 24)  # from max_window_layers on


REFUSED = [
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not implemented"),
    ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, "rope"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5 is not implemented"),
    ({"model_type": "smollm3"}, "unsupported model_type 'smollm3'"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["full_attention", "chunked_attention", "full_attention", "full_attention"]}, "chunked_attention"),
]


@pytest.mark.parametrize("change,says", REFUSED)
def test_unimplemented_config_fields_are_refused_by_name(tmp_path, change, says):
    path, _ = build(tmp_path, "llama_biases")
    raw = json.loads((path / "config.json").read_text())
    raw.update(change)
    raw.pop("rope_scaling", None)
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=says):
        Engine.from_pretrained(path, num_kv_tokens=256)


GEMMA_PROMPTS = ["Question: What is the capital of France?\nAnswer:",
                 "The three primary colors are",
                 # past the 512-token window of Gemma 3's local layers
                 "A short history of the printing press. " + " ".join(
                     f"In year {1440 + i} the presses of city number {i} printed {3 * i + 7} books." for i in range(60))]


@pytest.mark.slow
def test_real_gemma3_270m_matches_transformers():
    """The real Gemma 3 270M (the package index's Q4_K_M GGUF, de-quantized once): the engine's
    greedy tokens equal transformers' in fp32 on three real prompts, one past the local window."""
    from engines.known_models import known_model_path
    path = known_model_path("gemma3-270m")
    eng = Engine.from_pretrained(path, num_kv_tokens=4096)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [eng.tokenize(p) for p in GEMMA_PROMPTS]
    assert prompts[0][0] == hf.config.bos_token_id and len(prompts[2]) > 600
    outs = eng.generate(prompts, max_tokens=NEW, temperature=0.0, ignore_eos=True)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p), eng.tokenizer.decode(p[:12])
    assert "Paris" in outs[0].text


@pytest.mark.slow
def test_aiorouter_generate_answers_with_gemma3_270m():
    """A user names the model; one model serves alone (policy single). It is the pretrained Gemma 3
    270M (no chat tuning), so the question goes as completion text, with the tokenizer's BOS."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "server.cli", "generate", "--model", "g=gemma3-270m", "--raw",
                          "Question: What is the capital of France?\nAnswer:", "--max-tokens", "4"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout, out.stdout


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_quantized_moe_model_quantizes_its_experts(tmp_path, name):
    """`quantization="int8"` on a sparse model: every expert of every sparse layer is quantized (no
    dense expert weight left, which would be the option silently half-applied), and the first-step
    logits stay within int8's error of transformers' fp32 ones."""
    from engines.moe import Experts
    from engines.quant import QuantLinear
    path, hf = build(tmp_path, name)
    eng = Engine.from_pretrained(path, num_kv_tokens=512, quantization="int8")
    experts = [m for m in eng.runner.model.modules() if isinstance(m, Experts)]
    assert len(experts) == sum(eng.model_config.is_moe(i) for i in range(eng.model_config.num_hidden_layers)) > 0
    for e in experts:
        assert not list(e.parameters(recurse=False))
        assert all(isinstance(m, QuantLinear) and m.method == "int8" for pair in e.quantized for m in pair)
    prompt = torch.randint(2, 384, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    seq = eng.add_request(prompt, _forced(1))
    out = eng.forward()
    got = out.logits[0][:384].float()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.05, rel
    eng.append_token(seq, int(got.argmax()))
    assert seq.is_finished
