"""aiorouter: serving for token-level routed LLM inference."""
from aiorouter.defaults import DEFAULT_POLICY, DEFAULT_POLICY_ARGS, default_models, default_router
from aiorouter.request import GenerateResult, RouterError, StreamEvent
from aiorouter.router import Prompt, Router
from aiorouter.spec import ModelSpec

__all__ = ["Router", "ModelSpec", "Prompt", "StreamEvent", "GenerateResult", "RouterError", "run",
           "default_models", "default_router", "DEFAULT_POLICY", "DEFAULT_POLICY_ARGS"]


def run(main):
    """Run a coroutine on uvloop when it is installed (asyncio otherwise)."""
    try:
        import uvloop
        return uvloop.run(main)
    except ImportError:
        import asyncio
        return asyncio.run(main)
