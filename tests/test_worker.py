"""The model's worker thread: calls run in order in one thread, results and errors come back to
the awaiting coroutine, and shutting down runs or cancels what is queued."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engines.worker import Worker


def test_calls_run_in_order_in_one_named_thread_with_its_initializer():
    seen: list[tuple[str, int]] = []
    local = threading.local()

    async def main() -> None:
        w = Worker("aiorouter-test", lambda v: setattr(local, "v", v), (7,))
        got = await asyncio.gather(*(w.call(lambda i=i: seen.append((threading.current_thread().name, i))
                                            or getattr(local, "v", None)) for i in range(20)))
        assert got == [7] * 20 and seen == [("aiorouter-test", i) for i in range(20)]
        with pytest.raises(ZeroDivisionError):
            await w.call(lambda: 1 / 0)
        assert await w.call(pow, 2, 10) == 1024 and w.submit(pow, 3, 2).result() == 9  # still serving
        w.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            await w.call(int)

    asyncio.run(main())


def test_shutdown_cancels_queued_calls_when_asked():
    async def main() -> None:
        w = Worker("aiorouter-test")
        gate = threading.Event()
        first = asyncio.ensure_future(w.call(gate.wait, 5))
        queued = asyncio.ensure_future(w.call(int, "3"))
        await asyncio.sleep(0.05)  # the first call is running, the others wait behind it
        plain = w.submit(int, "4")
        w.shutdown(wait=False, cancel_futures=True)
        gate.set()
        assert await first is True
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert plain.cancelled()

    asyncio.run(main())


def test_an_awaiting_task_cancelled_leaves_the_worker_serving():
    async def main() -> None:
        w = Worker("aiorouter-test")
        slow = asyncio.ensure_future(w.call(time.sleep, 0.1))
        await asyncio.sleep(0.01)
        slow.cancel()
        assert await w.call(int, "5") == 5  # the cancelled call finished first, its result dropped quietly
        w.shutdown()

    asyncio.run(main())
