"""Router checkpoints as their authors save them, and what a policy reads from an HF model directory.

- R2R: a `torch.save`d dict {"model_type", "init_args", "common_args", "model_specific_args",
  "state_dict"} without `token_embeddings.weight` (a frozen copy of the small model's input
  embedding, rebuilt from it). `init_args` holds only what R2R's trainer passed (its
  `capture_init_args`); the class defaults (`R2R_DEFAULTS`) fill in the rest.
- CITER: a bare `state_dict` (`mlp_iter_*.pth`: keys mlp.0/1/4 and linear); the hidden size is the
  small model's. Our trainer also writes `<file>.json` with its threshold and figures, for people.
- Co-LLM: no file of its own. Its small model's output head has one row past the vocabulary, the
  deferral head (`write_deferral_model` writes one); a separate head is also read (`load_linear_head`).

Files are opened with `weights_only=True`; one that needs a full unpickle (which runs code from the
file) is opened only when the caller says `trust_checkpoint=True`.
"""
from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from policies.networks import CITERRouter, LinearHead, R2RRouter

R2R_MODEL_TYPE = "HiddenStatesTokenLMHeadLogitsClassifier"  # the official class name
# R2R's class defaults, for the init_args its checkpoints leave out
R2R_DEFAULTS: dict[str, Any] = {"hidden_states_size": 1536, "logits_size": 100, "hidden_dims": [256, 512, 256],
                                "expansion_factor": 4, "dropout_rate": 0.3, "normalize_input": False,
                                "pretrained_model_name": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
                                "use_position_embedding": False, "max_position_embeddings": 1024}
CITER_KEYS = ("mlp.0.weight", "mlp.1.running_mean", "mlp.4.weight", "linear.weight")
EMBED_KEYS = ("model.embed_tokens.weight", "embed_tokens.weight", "model.embed_tokens")
DEFER_TOKEN = "<|defer|>"  # Co-LLM's name for the deferral token


def torch_load(path: str | Path, what: str, trust_checkpoint: bool = False) -> Any:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist")
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not trust_checkpoint:
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            held = f"a {found.group(1)}" if found else "Python objects beyond tensors and plain data"
            raise ValueError(f"{what} {path} holds {held}, which only a full unpickle restores; unpickling runs "
                             "code from the file, so it is opened only with trust_checkpoint=True: pass it if you "
                             "trust where the file came from") from None
    return torch.load(str(path), map_location="cpu", weights_only=False)


# -- R2R -----------------------------------------------------------------------------------------
def read_router(src: str | Path | dict, trust_checkpoint: bool = False) -> dict:
    """An R2R checkpoint dict, checked: model_type, init_args (defaults filled in), common_args,
    model_specific_args, state_dict."""
    name = str(src) if isinstance(src, (str, Path)) else "dict"
    if isinstance(src, (str, Path)):
        src = torch_load(src, "router checkpoint", trust_checkpoint)
    if not isinstance(src, dict) or "model_type" not in src or "state_dict" not in src:
        raise ValueError(f"router checkpoint {name} is not in the R2R format: a dict with 'model_type', "
                         "'init_args', 'common_args' and 'state_dict'")
    if src["model_type"] != R2R_MODEL_TYPE:
        raise ValueError(f"router checkpoint {name}: unsupported model_type {src['model_type']!r}; "
                         f"supported: {R2R_MODEL_TYPE}")
    init = {**R2R_DEFAULTS, **(src.get("init_args") or {})}
    return {"name": name, "model_type": src["model_type"], "init_args": init,
            "common_args": dict(src.get("common_args") or {}),
            "model_specific_args": dict(src.get("model_specific_args") or {}), "state_dict": dict(src["state_dict"])}


def build_router(ckpt: dict, embedding: torch.Tensor | None) -> R2RRouter:
    """The network of a `read_router` dict; `embedding`: the small model's input embedding [V, E]
    (unused when the checkpoint carries its own)."""
    name, init, sd = ckpt["name"], ckpt["init_args"], dict(ckpt["state_dict"])
    H = int(init["hidden_states_size"])
    if "token_embeddings.weight" in sd:
        embedding = sd["token_embeddings.weight"]
    if embedding is None:
        raise ValueError(f"router checkpoint {name} has no token_embeddings.weight: give the small model's "
                         "path (small_path=...) so its embedding can be loaded")
    cp = sd.get("combined_projection.weight")
    if cp is None:
        raise ValueError(f"router checkpoint {name} lacks combined_projection.weight")
    if embedding.shape[1] != cp.shape[1] - 2 * H:
        raise ValueError(f"router checkpoint {name} is for hidden size {H}, but the small model's embedding "
                         f"has width {embedding.shape[1]} (a router trained for a different small model?)")
    net = R2RRouter(embedding.float(), H, logits_size=int(init["logits_size"]), hidden_dims=list(init["hidden_dims"]),
                    expansion_factor=int(init["expansion_factor"]), dropout_rate=float(init["dropout_rate"]),
                    normalize_input=bool(init["normalize_input"]),
                    use_position_embedding=bool(init["use_position_embedding"]),
                    max_position_embeddings=int(init["max_position_embeddings"]),
                    pretrained_model_name=init.get("pretrained_model_name"))
    sd["token_embeddings.weight"] = net.token_embeddings.weight.detach().clone()
    _load_strict(net, sd, f"router checkpoint {name}")
    return net.eval()


def load_router(src: str | Path | dict, embedding: torch.Tensor | None = None, device: str | torch.device = "cpu",
                trust_checkpoint: bool = False) -> tuple[R2RRouter, dict]:
    """-> (network in eval mode, {"model_type", "init_args", "common_args", "model_specific_args"})."""
    ckpt = read_router(src, trust_checkpoint)
    meta = {k: ckpt[k] for k in ("model_type", "init_args", "common_args", "model_specific_args")}
    return build_router(ckpt, embedding).to(device), meta


def _load_strict(net: nn.Module, sd: dict, what: str) -> None:
    try:
        net.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{what}: weights do not match the network: {e}") from None


# -- CITER ---------------------------------------------------------------------------------------
def load_citer(src: str | Path | dict, trust_checkpoint: bool = False) -> tuple[CITERRouter, dict]:
    """A CITER `ConfidenceModel` state dict (a file as CITER saves it, or the dict) -> (network in
    eval mode, the `<file>.json` our trainer writes beside it, or {})."""
    name = str(src) if isinstance(src, (str, Path)) else "dict"
    sd = torch_load(src, "CITER router", trust_checkpoint) if isinstance(src, (str, Path)) else src
    if not isinstance(sd, dict) or not all(k in sd for k in CITER_KEYS):
        keys = ", ".join(list(sd)[:6]) if isinstance(sd, dict) else type(sd).__name__
        raise ValueError(f"CITER router {name} is not a ConfidenceModel state dict (keys mlp.0.*, mlp.1.*, "
                         f"mlp.4.*, linear.*, as CITER's mlp_training.py saves it); found: {keys}")
    net = CITERRouter(int(sd["linear.weight"].shape[1]))
    _load_strict(net, sd, f"CITER router {name}")
    side = Path(f"{src}.json") if isinstance(src, (str, Path)) else None
    meta = json.loads(side.read_text()) if side is not None and side.is_file() else {}
    return net.eval(), meta


def save_router(model: nn.Module, path: str | Path, threshold: float | None, **model_specific_args: Any) -> dict:
    """Write `model` as its authors do: R2R's dict without token_embeddings.weight; CITER's bare
    state dict, with the threshold and `model_specific_args` in `<path>.json` beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = json.loads(json.dumps(model_specific_args, default=str))
    thr = None if threshold is None else float(threshold)
    if isinstance(model, CITERRouter):
        sd = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        torch.save(sd, str(path))
        Path(f"{path}.json").write_text(json.dumps({"format": "CITER ConfidenceModel state_dict",
                                                    "hidden_size": model.hidden_size, "threshold": thr, **extra},
                                                   indent=1))
        return sd
    if not isinstance(model, R2RRouter):
        raise TypeError(f"cannot save a {type(model).__name__} as a router")
    sd = {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k != "token_embeddings.weight"}
    ckpt = {"model_type": R2R_MODEL_TYPE, "init_args": dict(model.init_args),
            "common_args": {"threshold": thr, "input_type": ["hidden_states", "token", "logits"]},
            "model_specific_args": extra, "state_dict": sd}
    torch.save(ckpt, str(path))
    return ckpt


# -- HF model directories: an embedding, a head, Co-LLM's extra row -------------------------------
def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors weights at {str(path)!r}")
    return files


def _read_first(path: Path, keys: tuple[str, ...]) -> tuple[str, torch.Tensor] | None:
    """The first of `keys` found in the safetensors file(s) at `path`, read alone."""
    from safetensors import safe_open
    for key in keys:
        for f in _weight_files(path):
            with safe_open(str(f), framework="pt", device="cpu") as st:
                if key in st.keys():
                    return key, st.get_tensor(key)
    return None


def load_embedding(model_dir: str | Path) -> torch.Tensor:
    """The input-embedding matrix [V, H] of an HF safetensors model directory (read lazily)."""
    found = _read_first(Path(model_dir), EMBED_KEYS)
    if found is None:
        raise ValueError(f"{model_dir}: no {EMBED_KEYS[0]!r} in its safetensors files")
    return found[1].float()


def load_output_head(model_dir: str | Path) -> torch.Tensor:
    """The output head [V, H] of an HF model directory: lm_head.weight, or the embedding it is tied to."""
    found = _read_first(Path(model_dir), ("lm_head.weight",) + EMBED_KEYS)
    if found is None:
        raise ValueError(f"{model_dir}: no lm_head.weight or embed_tokens in its safetensors files")
    return found[1].float()


def load_linear_head(src: str | Path | dict | torch.Tensor) -> LinearHead:
    """A linear head in one of these forms:
    - a dict (or a `torch.save`d file of one) {"weight": [H] or [1, H], "bias": float (optional)};
    - an (H,) tensor;
    - the last row of a (V+1)-row output head: a (V+1, H) tensor, `lm_head.weight` in a .pt file,
      or a .safetensors file or model directory (a tied one has no `lm_head.weight`: its
      `embed_tokens` is the head). V is checked against the model."""
    name = str(src) if isinstance(src, (str, Path)) else type(src).__name__
    if isinstance(src, (str, Path)) and (Path(src).is_dir() or Path(src).suffix == ".safetensors"):
        found = _read_first(Path(src), ("lm_head.weight",) + EMBED_KEYS)  # tied: the embedding is the head
        if found is None:
            raise ValueError(f"head {name}: no lm_head.weight or embed_tokens in its safetensors files")
        bias = _read_first(Path(src), ("lm_head.bias",)) if found[0] == "lm_head.weight" else None
        obj: Any = {found[0]: found[1], **({"lm_head.bias": bias[1]} if bias else {})}
    else:
        obj = torch_load(src, "head") if isinstance(src, (str, Path)) else src
    if isinstance(obj, torch.Tensor):
        obj = {"tensor": obj}
    if not isinstance(obj, dict):
        raise ValueError(f"head {name}: expected a dict or a tensor, got {type(obj).__name__}")
    if "weight" in obj:
        w = torch.as_tensor(obj["weight"])
        if w.dim() == 2 and w.shape[0] != 1:
            raise ValueError(f"head {name}: 'weight' must have shape [H] or [1, H], got {tuple(w.shape)}")
        return LinearHead(w, float(torch.as_tensor(obj.get("bias", 0.0)).reshape(-1)[0]), source=name)
    keys = ("lm_head.weight", "tensor") + EMBED_KEYS
    mat = next((obj[k] for k in keys if k in obj), None)
    if mat is None:
        mats = [v for v in obj.values() if isinstance(v, torch.Tensor) and v.dim() == 2]
        mat = mats[0] if len(mats) == 1 else None
    if not isinstance(mat, torch.Tensor) or mat.dim() not in (1, 2):
        raise ValueError(f"head {name}: found neither 'weight' nor an 'lm_head.weight' matrix "
                         f"(keys: {', '.join(list(obj)[:8])})")
    if mat.dim() == 1:
        return LinearHead(mat, source=name)
    bias = obj.get("lm_head.bias")
    return LinearHead(mat[-1], float(bias[-1]) if bias is not None else 0.0, vocab=mat.shape[0] - 1, source=name)


def write_deferral_model(small_dir: str | Path, out_dir: str | Path, row: torch.Tensor) -> Path:
    """Write the small model with Co-LLM's layout: one more output row, `row` [H], the deferral head
    (its logit's sigmoid is P(defer)), and one more input-embedding row, the mean of the others (as
    Co-LLM initializes it; it is never fed). A tied model's single matrix gets `row`, as Co-LLM's
    resize leaves it. The tokenizer gets Co-LLM's `<|defer|>` token when it has exactly V tokens."""
    from safetensors.torch import load_file, save_file
    src, out = Path(small_dir), Path(out_dir)
    cfg = json.loads((src / "config.json").read_text())
    V, tied = int(cfg["vocab_size"]), bool(cfg.get("tie_word_embeddings", False))
    w: dict[str, torch.Tensor] = {}
    for f in _weight_files(src):
        w.update(load_file(str(f)))
    ek = next((k for k in EMBED_KEYS if k in w), None)
    if ek is None or w[ek].shape[0] != V:
        raise ValueError(f"{src}: expected an input embedding of {V} rows (config.json's vocab_size)")
    emb = w[ek]
    if row.numel() != emb.shape[1]:
        raise ValueError(f"the deferral row has {row.numel()} weights; {src} has hidden size {emb.shape[1]}")
    new = row.detach().reshape(1, -1).to(emb.dtype)
    w[ek] = torch.cat([emb, new if tied else emb.float().mean(0, keepdim=True).to(emb.dtype)])
    if not tied:
        if "lm_head.weight" not in w:
            raise ValueError(f"{src}: config.json says the embeddings are untied but there is no lm_head.weight")
        w["lm_head.weight"] = torch.cat([w["lm_head.weight"], new.to(w["lm_head.weight"].dtype)])
        if "lm_head.bias" in w:
            w["lm_head.bias"] = torch.cat([w["lm_head.bias"], w["lm_head.bias"].new_zeros(1)])
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # tokenizer, generation config, chat template: as they are
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps({**cfg, "vocab_size": V + 1}, indent=2))
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    _add_defer_token(src, out, V)
    return out


def _add_defer_token(src: Path, out: Path, V: int) -> None:
    if not any(src.glob("tokenizer*")):
        return
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(src))
    if len(tok) == V:  # a padded vocabulary already has rows past its tokens: leave it
        tok.add_tokens([DEFER_TOKEN], special_tokens=True)
        tok.save_pretrained(str(out))
