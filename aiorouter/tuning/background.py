"""Re-solves while serving, run in a child process at the lowest CPU priority.

Why: a re-solve of the threshold table is seconds of CPU (cpu-tiny, N = 1..16: ~15 s). Run in a
thread of the serving process it took those seconds from the models on a CPU host, and held the
GIL against the event loop and the models' workers on any host: the cpu-tiny pair at N = 16
(delayed, thresholds "auto", 32 requests) served 158-171 tok/s with the re-solve running
against 182-206 with the same thresholds fixed and none. In a child at nice 19 the solve takes
only the cycles the models leave, and the serving process does not run it at all.

The child is spawned (not forked: the serving process has threads, whose locks a fork would
copy held) for each re-solve, so one that is cancelled, or the router that closes, ends it at
once (`cancel`) and nothing of it outlives the router.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
from typing import Any, Callable

from .online import TuningCancelled

NICE = 19  # the lowest priority: the models' threads always go first


def _child(conn, fn: Callable[..., Any], args: tuple) -> None:
    try:
        os.nice(NICE)
    except OSError:  # (a platform without nice: the solve still runs, at normal priority)
        pass
    try:
        conn.send((True, fn(*args)))
    except BaseException as e:  # everything goes back to the parent, which raises it there
        conn.send((False, e))
    finally:
        conn.close()


class BackgroundCancelled(TuningCancelled):
    """The solve's process was ended by `cancel` (the router closed) before it answered."""


class BackgroundSolver:
    """`run(fn, *args)` in a fresh child process at nice 19, blocking the calling thread (not the
    event loop: call it from a worker thread) until the child answers. `fn` and `args` must be
    picklable (a module-level function and plain data); the child raises nothing into the
    parent but what `fn` raised, re-raised here."""

    def __init__(self, start_method: str = "spawn"):
        self._ctx = mp.get_context(start_method)
        self._lock = threading.Lock()
        self._proc = None
        self._cancelled = False

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        recv, send = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=_child, args=(send, fn, args), daemon=True, name="aiorouter-resolve")
        with self._lock:
            if self._cancelled:
                raise BackgroundCancelled("the background solver was cancelled")
            proc.start()
            self._proc = proc
        send.close()  # the child holds the only writer: recv() sees EOF if it dies
        try:
            ok, value = recv.recv()
        except EOFError:
            proc.join()
            if self._cancelled:
                raise BackgroundCancelled("the background solve was cancelled") from None
            raise RuntimeError(f"the background solve's process died (exit code {proc.exitcode})") from None
        finally:
            recv.close()
            with self._lock:
                self._proc = None
        proc.join()
        if not ok:
            raise value
        return value

    def cancel(self) -> None:
        """End the running solve (if any) and refuse later ones."""
        with self._lock:
            self._cancelled = True
            proc = self._proc
        if proc is not None and proc.is_alive():
            proc.terminate()
