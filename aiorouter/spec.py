"""How a router is told about its models, and how it builds their engines and sizes their KV."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from engines import Engine, EngineConfig, ModelConfig
from engines.devices import parse_devices
from engines.engine import parse_dtype
from engines.quant import QUANTIZATIONS
from engines.streams import StreamFactory


@dataclass(frozen=True)
class ModelSpec:
    """One cooperating model. `engine="sim"` needs no weights: it sleeps L(b) = a + c*b."""

    # a model directory, or a known model's name (engines/known_models.py, e.g. "gemma3-270m"):
    # a name that is not also an existing path becomes its built directory here, built on first use
    path: str | None = None
    # "cpu", "cuda:0", or a group "cuda:0,1" (its layers split across the GPUs in order, an
    # in-process pipeline); two models may name the same GPU. None: the router's device
    device: str | None = None
    dtype: str = "float32"
    kv_share: float | None = None  # share of the router's KV memory; None: an equal split
    num_kv_tokens: int | None = None  # explicit KV capacity (overrides kv_share)
    engine: Literal["real", "sim"] = "real"
    latency_ms: float = 6.0  # sim: a, per-step latency at batch 0
    latency_slope_ms: float = 0.0  # sim: c, added per sequence in the batch
    vocab_size: int = 512  # sim only
    token_seed: int = 0  # sim only: engines with equal seeds emit equal tokens
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    # quantized linear layers (engines/quant.py): "int4" or "int8" on CPU, "int4" on CUDA; None:
    # as the checkpoint's config.json declares (dense unless it asks). Overrides engine_config's.
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.engine not in ("real", "sim"):
            raise ValueError(f"engine must be 'real' or 'sim', got {self.engine!r}")
        if self.engine == "real" and not self.path:
            raise ValueError("a real model spec needs a path")
        if self.engine == "real" and not Path(self.path).expanduser().exists():
            from engines.known_models import KNOWN_MODELS, known_model_path
            if self.path in KNOWN_MODELS:  # frozen: the resolved directory replaces the name once
                object.__setattr__(self, "path", str(known_model_path(self.path)))
        if self.device is not None:
            parse_devices(self.device)  # a bad group fails here, with the spec, not at load time
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, "
                             f"got {self.quantization!r}")
        if self.quantization is not None and self.engine == "sim":
            raise ValueError("a sim model has no weights to quantize; drop quantization")
        if self.kv_share is not None and not 0 < self.kv_share <= 1:
            raise ValueError(f"kv_share must be in (0, 1], got {self.kv_share}")

    @staticmethod
    def coerce(value: "str | Path | dict | ModelSpec") -> "ModelSpec":
        if isinstance(value, ModelSpec):
            return value
        if isinstance(value, (str, Path)):
            return ModelSpec(path=str(value))
        if isinstance(value, dict):
            value = dict(value)
            if isinstance(value.get("engine_config"), dict):
                value["engine_config"] = EngineConfig(**value["engine_config"])
            try:
                return ModelSpec(**value)
            except TypeError as e:
                raise ValueError(f"bad model spec {value!r}: {e}") from None
        raise ValueError(f"a model must be a path, a dict or a ModelSpec, got {type(value).__name__}")

    def build(self, default_device: str, kv_memory_gb: float, num_models: int,
              streams: StreamFactory | None = None) -> Engine:
        """This model's engine. Its KV pool is `num_kv_tokens` if set, else its share (`kv_share`, or
        an equal split between the router's models) of `kv_memory_gb`, in its own KV bytes per token.
        `streams`: the router's CUDA stream factory, so no two models share a stream."""
        self._check_path()
        ecfg = replace(self.engine_config, num_kv_tokens=self.kv_tokens(kv_memory_gb, num_models))
        if self.quantization is not None:
            ecfg = replace(ecfg, quantization=self.quantization)
        if self.engine == "sim":
            from engines.sim import SimEngine
            return SimEngine(self.latency_ms / 1000, self.latency_slope_ms / 1000, self.vocab_size, ecfg, self.token_seed)
        return Engine(self.path, device=self.device or default_device, dtype=self.dtype, config=ecfg, streams=streams)

    def kv_tokens(self, kv_memory_gb: float, num_models: int) -> int:
        if self.num_kv_tokens is not None:
            return self.num_kv_tokens
        if self.engine == "sim":
            return self.engine_config.num_kv_tokens
        self._check_path()
        share = self.kv_share or 1.0 / num_models
        per_tok = ModelConfig.from_dir(self.path).kv_bytes_per_token(parse_dtype(self.dtype))
        return max(self.engine_config.page_size * 64, int(kv_memory_gb * share * 2**30 / per_tok))

    def _check_path(self) -> None:
        # Checked when the engine is built, not in __post_init__: specs of paths that do not exist
        # yet (written later, or only described) are fine until then.
        if self.engine == "real" and not Path(self.path).expanduser().exists():
            from engines.known_models import known_names
            raise FileNotFoundError(f"model path {self.path!r} does not exist and is not a known model name "
                                    f"(known names: {known_names()})")
