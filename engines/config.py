"""Typed configs: what a model is (read from HF `config.json`) and how an engine serves it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from engines.quant import QUANTIZATIONS

LOAD_FORMATS = ("safetensors", "dummy")

# model_type -> what sets it apart from a Llama (every other difference comes from config fields)
FAMILIES: dict[str, dict] = {
    "llama": {}, "mistral": {}, "granite": {}, "phi3": {},
    "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": "head"},
    "qwen2_moe": {"qkv_bias": True, "moe": True}, "qwen3_moe": {"qk_norm": "head", "moe": True},
    "olmo2": {"qk_norm": "proj", "norms": "post"},
    # Gemma: RMSNorm weight w used as (1 + w), embeddings times sqrt(hidden), four norms per layer
    "gemma2": {"norms": "sandwich", "one_plus_norm": True, "scaled_embed": True},
    "gemma3_text": {"norms": "sandwich", "one_plus_norm": True, "scaled_embed": True, "qk_norm": "head"},
}
SUPPORTED_ARCHS = tuple(FAMILIES)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


class Rope(NamedTuple):
    """One rotary table's frequencies, as transformers' rope functions compute them.
    `long_inv_freq` (longrope): the frequencies for positions >= `long_from`."""
    inv_freq: tuple[float, ...]  # [rotary_dim / 2]
    attention_factor: float = 1.0  # cos and sin are scaled by it (yarn, longrope)
    long_inv_freq: tuple[float, ...] | None = None
    long_from: int = 0


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q, k, v biases (qwen2 style; llama's attention_bias also sets o_bias)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k (qwen3, gemma3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    o_bias: bool = False  # o_proj bias (llama's attention_bias)
    qk_norm_proj: bool = False  # RMSNorm over the whole q and k projections (olmo2)
    hidden_act: str = "silu"
    norms: str = "pre"  # "pre": llama; "sandwich": gemma (also after attn and mlp); "post": olmo2 (only after)
    one_plus_norm: bool = False  # checkpoint norm weights w act as (1 + w) (gemma); folded at load
    embed_scale: float = 1.0  # embeddings times this (gemma: sqrt(hidden); granite: embedding_multiplier)
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # gemma2's attn_logit_softcapping (0: none)
    final_softcap: float = 0.0  # logits -> c * tanh(logits / c) (gemma2's final_logit_softcapping)
    residual_multiplier: float = 1.0  # granite: each block's output is scaled before the residual add
    logits_scaling: float = 1.0  # granite: logits divided by it
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window (0: full attention); () all full
    layer_ropes: tuple[int, ...] = ()  # per layer: index into `ropes`; () all 0
    ropes: tuple[Rope, ...] = ()  # () : the default rope of rope_theta
    # mixture of experts (qwen2_moe, qwen3_moe); engines/moe.py
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()  # per layer: its MLP is the expert block

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def rope_index(self, layer: int) -> int:
        return self.layer_ropes[layer] if self.layer_ropes else 0

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @staticmethod
    def from_dir(path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        if not cfg_file.is_file():
            raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return ModelConfig.from_dict(raw, gen)

    @staticmethod
    def from_dict(raw: dict, gen: dict | None = None) -> "ModelConfig":
        """config.json -> ModelConfig. transformers' own config class reads it first, so every
        default and derived field (Qwen2's layer_types from max_window_layers, Gemma 3's from its
        pattern, rope_parameters from a legacy rope_scaling) is what transformers would use; then
        every field that changes the computation is either implemented or refused by name."""
        mt = raw.get("model_type")
        if mt not in FAMILIES:
            raise ValueError(f"unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        hf = _hf_config(mt, raw)
        fam = FAMILIES[mt]
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        eos = (gen or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        n = hf.num_hidden_layers
        _refuse_unimplemented(mt, hf)
        windows, layer_ropes, ropes = _attention_layout(mt, hf, n, head_dim)
        llama_bias = bool(getattr(hf, "attention_bias", False))
        moe = _moe_fields(mt, hf, n) if fam.get("moe") else {}
        scale = None
        if getattr(hf, "query_pre_attn_scalar", None):
            scale = float(hf.query_pre_attn_scalar) ** -0.5
        if mt == "granite":
            scale = float(hf.attention_multiplier)
        act = getattr(hf, "hidden_activation", None) or hf.hidden_act
        return ModelConfig(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_params(hf, None).get("rope_theta", 10000.0)),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=fam.get("qkv_bias", False) or llama_bias,
            o_bias=llama_bias and mt not in ("qwen2", "qwen2_moe"),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=fam.get("qk_norm") == "head",
            qk_norm_proj=fam.get("qk_norm") == "proj",
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            hidden_act=act,
            norms=fam.get("norms", "pre"),
            one_plus_norm=fam.get("one_plus_norm", False),
            embed_scale=(hf.hidden_size ** 0.5 if fam.get("scaled_embed") else
                         float(getattr(hf, "embedding_multiplier", 1.0)) if mt == "granite" else 1.0),
            attn_scale=scale,
            attn_softcap=float(getattr(hf, "attn_logit_softcapping", None) or 0.0),
            final_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
            residual_multiplier=float(getattr(hf, "residual_multiplier", 1.0)) if mt == "granite" else 1.0,
            logits_scaling=float(getattr(hf, "logits_scaling", 1.0)) if mt == "granite" else 1.0,
            layer_windows=windows, layer_ropes=layer_ropes, ropes=ropes, **moe,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elt = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elt


def _hf_config(mt: str, raw: dict):
    import transformers
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "transformers_version")}
    try:
        return transformers.AutoConfig.for_model(mt, **fields)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"config.json of a {mt} model: transformers refuses it: {e}") from None


def _rope_params(hf, layer_type: str | None) -> dict:
    rp = getattr(hf, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(rp.get(layer_type), dict):
        return rp[layer_type]
    return rp


def _refuse_unimplemented(mt: str, hf) -> None:
    """Every config field that changes the computation and that this engine does not implement
    is refused here, by name and value: the alternative is a model that loads and answers wrong."""
    act = getattr(hf, "hidden_activation", None) or hf.hidden_act
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not implemented; supported: {', '.join(ACTIVATIONS)}")
    rp = getattr(hf, "rope_parameters", None) or {}
    for params in (rp.values() if all(isinstance(v, dict) for v in rp.values()) and rp else [rp]):
        rt = params.get("rope_type", "default")
        if rt not in ROPE_TYPES:
            raise ValueError(f"rope_type {rt!r} is not implemented; supported: {', '.join(ROPE_TYPES)}")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor {params['partial_rotary_factor']} is not implemented (only 1.0)")
    if FAMILIES[mt].get("moe") and act != "silu":
        raise ValueError(f"hidden_act {act!r} is not implemented for an MoE model's experts (only silu)")
    bad = set(getattr(hf, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if bad:
        raise ValueError(f"layer_types {sorted(bad)} are not implemented; supported: full_attention, sliding_attention")
    if getattr(hf, "attn_logit_softcapping", None) and mt != "gemma2":
        raise ValueError(f"attn_logit_softcapping {hf.attn_logit_softcapping} is not implemented for {mt}")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention true is not implemented (a causal decoder only)")


def _attention_layout(mt: str, hf, n: int, head_dim: int):
    """-> (per-layer windows, per-layer rope index, ropes). A window comes from layer_types where
    the config has them (Qwen2, Gemma 2/3; transformers derives them), else from sliding_window
    alone on every layer (Mistral)."""
    types = list(getattr(hf, "layer_types", None) or [])
    sw = getattr(hf, "sliding_window", None) or 0
    if types:
        windows = tuple(sw if t == "sliding_attention" else 0 for t in types)
    elif mt == "mistral" and sw:
        windows = (sw,) * n
    else:
        windows = ()
    rp = getattr(hf, "rope_parameters", None) or {}
    per_type = bool(rp) and all(isinstance(v, dict) for v in rp.values())
    if not per_type:
        return (windows if any(windows) else ()), (), (_rope(hf, None, head_dim),)
    names = sorted(rp)  # e.g. full_attention, sliding_attention: one table each
    ropes = tuple(_rope(hf, t, head_dim) for t in names)
    return (windows if any(windows) else ()), tuple(names.index(t) for t in types), ropes


def default_rope(theta: float, head_dim: int) -> Rope:
    """The unscaled rope of base `theta`: inv_freq[i] = theta ** (-2i / head_dim)."""
    return Rope(tuple((1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))).tolist()))


def _rope(hf, layer_type: str | None, head_dim: int) -> Rope:
    """transformers' own rope functions (transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS)
    at their static lengths: within max_position_embeddings, which is what the engine serves,
    dynamic NTK is the default rope there too. Longrope's long factors apply from
    original_max_position_embeddings on (transformers switches the whole sequence once it is
    longer; the engine switches per position, as vLLM: the same within the original length)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = _rope_params(hf, layer_type)
    rt = params.get("rope_type", "default")
    base = float(params.get("rope_theta", 10000.0))
    if rt == "default":
        return default_rope(base, head_dim)
    kw = {"layer_type": layer_type} if layer_type is not None else {}
    inv, factor = ROPE_INIT_FUNCTIONS[rt](hf, torch.device("cpu"), **kw)
    if rt != "longrope":
        return Rope(tuple(inv.tolist()), float(factor))
    orig = int(params["original_max_position_embeddings"])
    long_inv, _ = ROPE_INIT_FUNCTIONS[rt](hf, torch.device("cpu"), seq_len=orig + 1, **kw)
    return Rope(tuple(inv.tolist()), float(factor), tuple(long_inv.tolist()), orig)


def _moe_fields(mt: str, hf, n: int) -> dict:
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    only_mlp = set(getattr(hf, "mlp_only_layers", None) or ())
    # transformers' rule: layer i is sparse when it is not mlp-only, there are experts, and (i + 1) % step == 0
    layers = tuple(i not in only_mlp and hf.num_experts > 0 and (i + 1) % step == 0 for i in range(n))
    return dict(num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
                shared_expert_intermediate_size=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0),
                moe_layers=layers)


@dataclass(frozen=True)
class EngineConfig:
    """How one engine serves its model. Defaults are sized for a CPU machine."""

    page_size: int = 16
    num_kv_tokens: int = 16384  # KV capacity in tokens (rounded up to whole pages)
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 2048  # tokens per forward (prefill chunks included)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # "torch" | "cpu" | "triton" | "flashinfer"; None picks by device (engines.attention.select_backend)
    attention_backend: str | None = None
    cuda_graphs: bool = True  # replay captured graphs for small steps (one CUDA device; CPU has none)
    # "safetensors": the checkpoint's weights; "dummy": random weights made on the device (normal,
    # std = config.json's initializer_range, seed 0), for benchmarks and checks with no checkpoint
    # on disk (a 32B model's weights would take minutes to write and read; these take a second)
    load_format: str = "safetensors"
    # "int4" | "int8": weight-only quantized linear layers (engines/quant.py); None: dense, unless the
    # checkpoint's config.json asks for a scheme (engines.quant.CONFIG_KEY; the argument wins)
    quantization: str | None = None

    def __post_init__(self) -> None:
        for name in ("page_size", "num_kv_tokens", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"EngineConfig.load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"EngineConfig.quantization must be one of {', '.join(QUANTIZATIONS)} or None, "
                             f"got {self.quantization!r}")

    @property
    def num_pages(self) -> int:
        return -(-self.num_kv_tokens // self.page_size)
