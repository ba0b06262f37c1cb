"""aiorouter: serving for token-level routed LLM inference.

The public names load on first use (PEP 562), not when the package is imported: a module deep in
the package (a re-solve's child process imports only `aiorouter.tuning`) then does not pay for
the router's imports. `import aiorouter.tuning.tuner` took 2.5 s (torch, transformers) when this
file imported the router, 0.6 s without it.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiorouter.defaults import DEFAULT_POLICY, DEFAULT_POLICY_ARGS, default_models, default_router
    from aiorouter.request import GenerateResult, RouterError, RouterRequestError, RouterUnavailable, StreamEvent
    from aiorouter.config import RouterConfig
    from aiorouter.router import Prompt, Router
    from aiorouter.scoring import ScoreResult
    from aiorouter.spec import ModelSpec

_EXPORTS = {
    "DEFAULT_POLICY": "aiorouter.defaults", "DEFAULT_POLICY_ARGS": "aiorouter.defaults",
    "default_models": "aiorouter.defaults", "default_router": "aiorouter.defaults",
    "GenerateResult": "aiorouter.request", "RouterError": "aiorouter.request",
    "RouterRequestError": "aiorouter.request", "RouterUnavailable": "aiorouter.request", "StreamEvent": "aiorouter.request",
    "Prompt": "aiorouter.router", "Router": "aiorouter.router", "RouterConfig": "aiorouter.config",
    "ModelSpec": "aiorouter.spec", "ScoreResult": "aiorouter.scoring",
}
__all__ = ["Router", "RouterConfig", "ModelSpec", "Prompt", "StreamEvent", "GenerateResult", "RouterError",
           "RouterRequestError", "RouterUnavailable", "ScoreResult", "run",
           "default_models", "default_router", "DEFAULT_POLICY", "DEFAULT_POLICY_ARGS"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aiorouter' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def run(main):
    """Run a coroutine on uvloop when it is installed (asyncio otherwise)."""
    try:
        import uvloop
        return uvloop.run(main)
    except ImportError:
        import asyncio
        return asyncio.run(main)
