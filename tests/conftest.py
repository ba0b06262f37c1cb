"""Shared fixtures: a tiny random Qwen3 saved like an HF checkpoint, and the real SmolLM2."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors only under its interpreter, which has to be on before triton is
# first imported (it decorates its own standard library then). Machines with CUDA compile them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Two models step in two threads in the runtime tests; one intra-op thread each is the
# setting the library uses on small CPUs too.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests skip exactly when CUDA is absent (pyproject's marker contract), here once."""
    if torch.cuda.is_available():
        return
    needs_cuda = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(needs_cuda)


def make_tiny_qwen3(path: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    vocab: int = 512, seed: int = 0, tie: bool = False, max_positions: int = 1024) -> Path:
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, intermediate_size=2 * hidden, vocab_size=vocab,
                                   head_dim=hidden // heads, max_position_embeddings=max_positions, tie_word_embeddings=tie,
                                   eos_token_id=1, bos_token_id=0)
    model = transformers.Qwen3ForCausalLM(cfg).float()
    # random init of norms is all-ones; perturb them so a norm bug cannot hide
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from engines.known_models import default_model_path
    return default_model_path()


def make_tiny_chat_model(path: Path, smollm2: Path, **kw) -> Path:
    """A tiny random Qwen3 that speaks SmolLM2's tokenizer (vocab 49152, ChatML template), so
    text and chat endpoints run on a model that steps in milliseconds."""
    import shutil
    make_tiny_qwen3(path, vocab=49152, seed=5, **kw)
    for f in smollm2.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy2(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smollm2) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"), smollm2)
