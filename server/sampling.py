"""What the server samples with when a request omits a field: the model's `generation_config.json`,
as vLLM does (`--generation-config auto`), or OpenAI's neutral values (`--generation-config neutral`,
vLLM's `vllm`). A chat model's authors often pick their sampling there (e.g. temperature 0.6,
top_p 0.95); a server that ignores it samples at temperature 1.0 and answers worse than the model can.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

GENERATION_CONFIG = "generation_config.json"
# generation_config.json key -> request field: the keys vLLM reads
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "max_new_tokens": "max_tokens", "repetition_penalty": "repetition_penalty"}
INT_FIELDS = ("top_k", "max_tokens")


@dataclass(frozen=True)
class SamplingDefaults:
    """Neutral values as the defaults; `source` says where the others came from."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = None  # None: the server's own default (ServerConfig.default_max_tokens)
    repetition_penalty: float = 1.0
    source: str = "neutral"

    def __post_init__(self) -> None:
        checks = {"temperature": math.isfinite(self.temperature) and self.temperature >= 0,
                  "top_p": 0 < self.top_p <= 1, "top_k": self.top_k >= -1, "min_p": 0 <= self.min_p <= 1,
                  "max_tokens": self.max_tokens is None or self.max_tokens >= 1,
                  "repetition_penalty": math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"{self.source}: out-of-range sampling default(s): "
                             + ", ".join(f"{k}={getattr(self, k)!r}" for k in bad))

    @staticmethod
    def load(setting: str, model_dir: str | Path | None) -> "SamplingDefaults":
        """`setting`: "auto" (the model's file, neutral where it is silent or absent), "neutral", or
        a directory holding a generation_config.json (its file must exist)."""
        if setting == "neutral":
            return SamplingDefaults()
        if setting == "auto":
            if model_dir is None or not (Path(model_dir) / GENERATION_CONFIG).is_file():
                return SamplingDefaults()
            path = Path(model_dir) / GENERATION_CONFIG
        else:
            path = Path(setting) / GENERATION_CONFIG
            if not path.is_file():
                raise ValueError(f"--generation-config {setting!r}: no {GENERATION_CONFIG} there "
                                 "(give 'auto', 'neutral' or a directory that holds one)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return SamplingDefaults.from_dict(raw, str(path))

    @staticmethod
    def from_dict(raw: dict, source: str) -> "SamplingDefaults":
        found = {}
        for key, name in KEYS.items():
            value = raw.get(key)
            if value is None:
                continue
            want = int if name in INT_FIELDS else float
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (want is int and value != int(value)):
                raise ValueError(f"{source}: {key} must be a{'n integer' if want is int else ' number'}, got {value!r}")
            found[name] = want(value)
        return replace(SamplingDefaults(source=source), **found)

    def describe(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                 if f.name != "source" and getattr(self, f.name) is not None]
        return f"{', '.join(shown)} ({self.source})"
