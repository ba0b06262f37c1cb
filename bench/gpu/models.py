"""The GPU check's models: Qwen3 shapes written as config-only checkpoint directories, served with
random weights made on the device (EngineConfig.load_format="dummy": a 32B model is ready in about
a second, where writing and reading its weights would take minutes and 64 GB of disk).

Shapes are Qwen3's own (hidden, layers, heads, KV heads, head dim 128, vocabulary 151936), so
kernels, GEMMs and the LM head are the sizes a real deployment runs; the dry run uses tiny ones.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engines import Engine, EngineConfig
from engines.streams import StreamFactory


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 151936
    head_dim: int = 128
    tie: bool = False
    std: float = 0.02  # initializer_range: the dummy weights' std

    @property
    def params(self) -> int:
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden + 2 * self.head_dim
        return self.layers * layer + self.vocab * self.hidden * (1 if self.tie else 2) + self.hidden

    def describe(self) -> dict:
        return {"name": self.name, "params_b": round(self.params / 1e9, 3), "hidden": self.hidden,
                "layers": self.layers, "heads": self.heads, "kv_heads": self.kv_heads,
                "intermediate": self.intermediate, "vocab": self.vocab, "head_dim": self.head_dim,
                "tied": self.tie, "std": self.std}


# Qwen3-0.6B and Qwen3-32B as published: the paper's pair (its ablation, Figure 1a).
QWEN3_0_6B = Shape("qwen3-0.6b", 1024, 28, 16, 8, 3072, tie=True)
QWEN3_32B = Shape("qwen3-32b", 5120, 64, 64, 8, 25600)
# ~1B and ~7B for decode speed: Qwen3-1.7B's layers (16 of its 28) and Qwen3-8B's (32 of its 36)
QWEN3_1B = Shape("qwen3-1b (1.7B layers x16)", 2048, 16, 16, 8, 6144, tie=True)
QWEN3_7B = Shape("qwen3-7b (8B layers x32)", 4096, 32, 32, 8, 12288)
# parity: small enough to run six engines in seconds; head dim 128 and GQA 4 as the real ones
PARITY = Shape("parity", 512, 4, 8, 2, 1536, vocab=8192)
# host overhead: steps so cheap on a GPU that what remains per token is the runtime's own time
HOST_SMALL = Shape("host-small", 256, 2, 4, 2, 768, vocab=8192, head_dim=64)
HOST_LARGE = Shape("host-large", 256, 4, 4, 2, 768, vocab=8192, head_dim=64)

TINY = dict(vocab=512, head_dim=16)  # the dry run's scale (CPU)
DRY = {s.name: s for s in (
    Shape("qwen3-0.6b", 64, 2, 4, 2, 128, tie=True, **TINY), Shape("qwen3-32b", 128, 3, 4, 2, 256, **TINY),
    Shape("qwen3-1b (1.7B layers x16)", 64, 2, 4, 2, 128, tie=True, **TINY),
    Shape("qwen3-7b (8B layers x32)", 128, 2, 4, 2, 256, **TINY),
    Shape("parity", 64, 2, 4, 2, 192, vocab=512, head_dim=32), Shape("host-small", 64, 1, 4, 2, 128, **TINY),
    Shape("host-large", 64, 2, 4, 2, 128, **TINY))}


def scaled(shape: Shape, dry: bool) -> Shape:
    """The shape itself, or its dry-run stand-in (same name, tiny), keeping a changed std."""
    return replace(DRY[shape.name], std=shape.std) if dry else shape


def model_dir(root: Path, shape: Shape) -> Path:
    """A checkpoint directory with config.json only (the weights are EngineConfig's "dummy")."""
    path = root / f"{shape.name.split()[0]}-std{shape.std}"
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": shape.vocab,
           "hidden_size": shape.hidden, "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
           "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
           "tie_word_embeddings": shape.tie, "initializer_range": shape.std, "eos_token_id": 1, "bos_token_id": 0}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


@dataclass(frozen=True)
class Run:
    """How the check runs engines: device, dtype, attention backend (None: the device's default,
    Triton on the H200; "torch": the fallback) and CUDA graphs (off in the fallback)."""
    device: torch.device
    dtype: torch.dtype
    attention: str | None
    graphs: bool

    def engine_config(self, **fields) -> EngineConfig:
        return EngineConfig(load_format="dummy", attention_backend=self.attention, cuda_graphs=self.graphs, **fields)

    def engine(self, root: Path, shape: Shape, streams: StreamFactory, dtype: torch.dtype | None = None,
               **fields) -> Engine:
        return Engine(model_dir(root, shape), device=self.device, dtype=dtype or self.dtype,
                      config=self.engine_config(**fields), load_tokenizer=False, streams=streams)


def free_cuda() -> dict:
    """Collect garbage and return cached blocks; -> memory still allocated (a leak shows here)."""
    import gc
    gc.collect()
    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
            "reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 2)}
