"""Load HF safetensors checkpoints (sharded or not) into `CausalLM`, merging q/k/v and gate/up."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engines.config import ModelConfig
from engines.model import CausalLM
from engines.moe import hf_param_slice
from engines.quant import check_quantization, declared_quantization, quantize_model

# HF name suffix -> (our parameter suffix, index of the shard inside the merged tensor)
_MERGED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model directory {str(path)!r} has no *.safetensors weights")
    return files


def _our_name(hf_name: str) -> tuple[str, int | None]:
    name = hf_name.removeprefix("model.")
    for src, (dst, shard) in _MERGED.items():
        if f".{src}." in name:
            return name.replace(src, dst), shard
    return name, None


def load_model(path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               load_format: str = "safetensors", quantization: str | None = None) -> CausalLM:
    """The model of checkpoint `path` on `device` in `dtype`; `load_format` "dummy": random
    weights instead (EngineConfig.load_format). `quantization`: "int4" / "int8" (engines/quant.py),
    applied once loaded; None: what the checkpoint's config.json asks for, else dense."""
    path = Path(path)
    quantization = check_quantization(quantization) or declared_quantization(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    # cast on meta, then allocate: the model never exists in fp32 (a 32B one would need 128 GB)
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if load_format == "dummy":
        return _quantized(_random_weights(model, path), quantization)
    if load_format != "safetensors":
        raise ValueError(f"unknown load_format {load_format!r}; use safetensors or dummy")
    params = dict(model.named_parameters(remove_duplicate=False))
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    split = {"self_attn.qkv_proj": [h * d, hkv * d, hkv * d], "mlp.gate_up_proj": [cfg.intermediate_size] * 2}
    loaded: set[str] = set()
    covered: dict[str, int] = {}  # stacked expert parameters: elements written so far
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for hf_name in f.keys():
                    if "rotary_emb" in hf_name:
                        continue
                    # an expert block's tensor is a slice of a stacked parameter; the rest map by name
                    hit = hf_param_slice(hf_name.removeprefix("model."), cfg) if cfg.num_experts else None
                    name, shard = (hit[0], None) if hit is not None else _our_name(hf_name)
                    if name not in params:
                        raise ValueError(f"{file}: unexpected weight {hf_name!r} for a {cfg.model_type} model")
                    t = f.get_tensor(hf_name)
                    dst = params[name].data
                    kind = ".".join(name.split(".")[-3:-1])
                    if hit is not None:
                        dst = dst[hit[1]]
                    elif shard is not None:
                        sizes = split[kind]
                        dst = dst.narrow(0, sum(sizes[:shard]), sizes[shard])
                    if tuple(t.shape) != tuple(dst.shape):
                        raise ValueError(f"{file}: weight {hf_name!r} has shape {tuple(t.shape)}, "
                                         f"config.json implies {tuple(dst.shape)}")
                    dst.copy_(t)
                    if hit is not None:
                        covered[name] = covered.get(name, 0) + dst.numel()  # slices never overlap
                    elif shard is not None:
                        loaded.add(f"{name}#{shard}")
                    elif kind in split:  # stored fused already (phi3's qkv_proj, gate_up_proj)
                        loaded.update(f"{name}#{i}" for i in range(len(split[kind])))
                    else:
                        loaded.add(name)
        except SafetensorError as e:
            raise ValueError(f"corrupt safetensors file {str(file)!r}: {e}") from None
    loaded.update(n for n, c in covered.items() if c == params[n].numel())
    expected = set()
    for name, p in params.items():
        kind = ".".join(name.split(".")[-3:-1])
        if kind in split:
            expected.update(f"{name}#{i}" for i in range(len(split[kind])))
        elif not (cfg.tie_word_embeddings and name == "lm_head.weight"):
            expected.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    if cfg.one_plus_norm:  # gemma's norms scale by (1 + w): fold the 1 in once, and every norm is one RMSNorm
        with torch.no_grad():
            for name, p in params.items():
                if name.endswith("norm.weight"):
                    p.add_(1.0)
    return _quantized(model.eval(), quantization)


def _quantized(model: CausalLM, quantization: str | None) -> CausalLM:
    if quantization is not None:
        quantize_model(model, quantization)
    return model


@torch.no_grad()
def _random_weights(model: CausalLM, path: Path) -> CausalLM:
    """Normal weights with std = config.json's initializer_range (HF's init; 0.02 when absent),
    norms 1 + N(0, 0.1) so a norm bug cannot hide behind all-ones; generated on the model's device
    in its dtype with seed 0, so two engines of one directory hold the same weights."""
    std = float(json.loads((path / "config.json").read_text()).get("initializer_range", 0.02))
    dev = model.embed_tokens.weight.device
    g = torch.Generator(dev).manual_seed(0)
    for name, p in model.named_parameters():  # a tied lm_head is listed once
        if "norm" in name:
            p.normal_(1.0, 0.1, generator=g)
        else:
            p.normal_(0.0, std, generator=g)
    return model.eval()
