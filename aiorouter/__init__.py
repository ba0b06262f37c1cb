"""aiorouter: serving for token-level routed LLM inference."""
from aiorouter.request import GenerateResult, RouterError, StreamEvent
from aiorouter.router import Router
from aiorouter.spec import ModelSpec

__all__ = ["Router", "ModelSpec", "StreamEvent", "GenerateResult", "RouterError", "run"]


def run(main):
    """Run a coroutine on uvloop when it is installed (asyncio otherwise)."""
    try:
        import uvloop
        return uvloop.run(main)
    except ImportError:
        import asyncio
        return asyncio.run(main)
