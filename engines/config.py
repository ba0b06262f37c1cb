"""Typed configs: what a model is (read from HF `config.json`) and how an engine serves it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.quant import QUANTIZATIONS

SUPPORTED_ARCHS = ("qwen3", "llama", "qwen2", "mistral")
LOAD_FORMATS = ("safetensors", "dummy")


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
    attention_bias: bool  # qkv bias (qwen2 style)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k (qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    rope_scaling: tuple[tuple[str, object], ...] | None = None

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
        mt = raw.get("model_type")
        if mt not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        heads = raw["num_attention_heads"]
        eos = (gen or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta = raw.get("rope_theta")
        rope_scaling = raw.get("rope_scaling") or None
        rp = raw.get("rope_parameters")  # transformers 5 moves rope settings here
        if isinstance(rp, dict):
            rope_theta = rope_theta or rp.get("rope_theta")
            if rp.get("rope_type", "default") != "default":
                rope_scaling = rp
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) not in ("default", "llama3"):
            raise ValueError(f"unsupported rope_scaling {rope_scaling!r}; supported: default, llama3")
        return ModelConfig(
            model_type=mt,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", mt == "qwen2")),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=mt == "qwen3",
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elt = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elt


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
