"""`Worker`: the one thread a model's forwards run in, while its owner's event loop goes on.

A call is a closure on a `queue.SimpleQueue` and, when done, one `call_soon_threadsafe` that
resolves the awaiting asyncio future. `loop.run_in_executor` on a one-thread `ThreadPoolExecutor`
does the same through a `concurrent.futures.Future` (its lock and condition) chained to an asyncio
one: 118 against 101 us a round trip of an empty call on the 2-core Intel VM (2026-12-05), and a
step makes one. It is still an `Executor` (`submit`), for callers that block on a result (the
start-up profiles).
"""
from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Executor, Future
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def _resolve(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if not fut.done():  # (the awaiting task may have been cancelled meanwhile)
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)


class Worker(Executor):
    def __init__(self, name: str, initializer: Callable[..., object] | None = None, initargs: tuple = ()):
        """`initializer(*initargs)` runs first, in the thread (a per-thread setting: torch's
        intra-op thread count)."""
        # (run it, cancel it): None ends the thread
        self._calls: queue.SimpleQueue[tuple[Callable[[], None], Callable[[], None]] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._main, args=(initializer, initargs), name=name, daemon=True)
        self._thread.start()

    def _main(self, initializer: Callable[..., object] | None, initargs: tuple) -> None:
        if initializer is not None:
            initializer(*initargs)
        while (call := self._calls.get()) is not None:
            call[0]()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in this thread; the caller's event loop goes on meanwhile."""
        if self._closed:
            raise RuntimeError("this worker is shut down")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run() -> None:
            try:
                value, ok = fn(*args), True
            except BaseException as e:  # noqa: BLE001 - the awaiting caller gets it, as from run_in_executor
                value, ok = e, False
            try:
                loop.call_soon_threadsafe(_resolve, fut, ok, value)
            except RuntimeError:  # the loop closed while this ran: nobody is waiting
                pass

        self._calls.put((run, lambda: loop.call_soon_threadsafe(fut.cancel)))
        return await fut

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if self._closed:
            raise RuntimeError("this worker is shut down")
        f: Future[T] = Future()

        def run() -> None:
            if f.set_running_or_notify_cancel():
                try:
                    f.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001
                    f.set_exception(e)

        self._calls.put((run, f.cancel))
        return f

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No call is taken after this; the ones queued run first, or with `cancel_futures` are
        cancelled (their callers get CancelledError)."""
        if not self._closed:
            self._closed = True
            if cancel_futures:
                while True:
                    try:
                        call = self._calls.get_nowait()
                    except queue.Empty:
                        break
                    if call is not None:
                        call[1]()
            self._calls.put(None)
        if wait:
            self._thread.join()
