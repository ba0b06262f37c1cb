"""The embedded default model (SmolLM2-135M-Instruct) builds from its GGUF and
works as a plain HF model. First run downloads ~93 MB and converts (~20 s)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import gguf  # noqa: F401  (a core dependency: GGUF import needs it)
import torch
import transformers

from engines.default_model import GGUF_IN_WHEEL, MARKER, cache_dir, convert_gguf_to_hf
from engines.known_models import default_model_path


@pytest.fixture(scope="session")
def model_dir() -> Path:
    # Session-scoped and cached on disk: the conversion happens at most once.
    return default_model_path()


def _gguf_ties_embeddings() -> bool:
    """Ground truth from the GGUF itself: no `output.weight` tensor means the
    LM head reuses `token_embd.weight`."""
    import gguf

    path = os.environ.get("AIOROUTER_SMOLLM2_GGUF") or cache_dir() / "gguf" / Path(GGUF_IN_WHEEL).name
    # default_model_path keeps the extracted GGUF beside the model (the model_dir fixture ran first)
    assert Path(path).is_file(), f"GGUF not kept at {path}"
    return "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}


def test_dir_is_complete_and_cached(model_dir: Path) -> None:
    assert (model_dir / MARKER).is_file()
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (model_dir / name).is_file(), name
    assert default_model_path() == model_dir  # second call: cache hit, same dir


def test_config_and_tokenizer(model_dir: Path) -> None:
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert cfg.vocab_size == 49152
    assert cfg.tie_word_embeddings == _gguf_ties_embeddings()
    assert getattr(cfg, "quantization_config", None) is None

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert tok.eos_token == "<|im_end|>"
    assert cfg.eos_token_id == tok.eos_token_id
    assert "<|im_start|>" in tok.chat_template


def test_generates_paris(model_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    print("HF generate answered:", repr(answer))
    assert "Paris" in answer


def test_corrupt_gguf_names_file(tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises((ValueError, RuntimeError, OSError)) as exc:
        convert_gguf_to_hf(bad, tmp_path / "out")
    assert str(bad) in str(exc.value)
    assert not (tmp_path / "out").exists()


def test_truncated_gguf_names_file(tmp_path: Path) -> None:
    bad = tmp_path / "truncated.gguf"  # right magic, garbage body
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(ValueError) as exc:
        convert_gguf_to_hf(bad, tmp_path / "out")
    assert str(bad) in str(exc.value)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_missing_gguf(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert_gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "out")
