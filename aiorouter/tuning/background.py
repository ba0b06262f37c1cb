"""Re-solves while serving, run in a child process at the lowest CPU priority.

Why: a re-solve of the threshold table is seconds of CPU (cpu-tiny, N = 1..16: ~15 s). Run in a
thread of the serving process it took those seconds from the models on a CPU host, and held the
GIL against the event loop and the models' workers on any host: the cpu-tiny pair at N = 16
(delayed, thresholds "auto", 32 requests) served 158-171 tok/s with the re-solve running
against 182-206 with the same thresholds fixed and none.

The child runs under SCHED_IDLE where Linux offers it (nice 19 elsewhere): a model's thread that
wakes takes its core back at once, where at nice 19 the scheduler still gives the child a slice.
The child is a fresh interpreter that imports only `aiorouter.tuning` (0.6 s), started with
`python -m`: a multiprocessing "spawn" child also re-imports the parent's main script and, with
it, torch and the router (2.5 s more of CPU, and the whole script for one without a main guard).
A re-solve's request and answer are pickled through its stdin and stdout. One child per re-solve,
so a cancelled one, or the router that closes, ends it at once (`cancel`) and nothing of it
outlives the router.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from typing import Any, Callable

from .online import TuningCancelled

NICE = 19  # the lowest niceness, for platforms without SCHED_IDLE (and set under it too)


def lowest_priority() -> str:
    """Put this process at the lowest CPU priority the platform offers -> which one it got."""
    got = "normal"
    try:
        os.nice(NICE)
        got = "nice 19"
    except (AttributeError, OSError):
        pass
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        got = "SCHED_IDLE"
    except (AttributeError, OSError):
        pass
    return got


class BackgroundCancelled(TuningCancelled):
    """The solve's process was ended by `cancel` (the router closed) before it answered."""


class BackgroundSolver:
    """`run(fn, *args)` in a fresh child process at the lowest priority, blocking the calling thread
    (not the event loop: call it from a worker thread) until the child answers. `fn` and `args` must
    be picklable (a module-level function and plain data); the child raises nothing into the parent
    but what `fn` raised, re-raised here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._cancelled = False

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        request = pickle.dumps((fn, args))
        with self._lock:
            if self._cancelled:
                raise BackgroundCancelled("the background solver was cancelled")
            proc = self._proc = subprocess.Popen([sys.executable, "-m", "aiorouter.tuning._child"],
                                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            answer, _ = proc.communicate(request)
        finally:
            with self._lock:
                self._proc = None
        if self._cancelled:
            raise BackgroundCancelled("the background solve was cancelled")
        try:
            ok, value = pickle.loads(answer)
        except Exception:
            raise RuntimeError(f"the background solve's process died (exit code {proc.returncode})") from None
        if not ok:
            raise value
        return value

    def cancel(self) -> None:
        """End the running solve (if any) and refuse later ones."""
        with self._lock:
            self._cancelled = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
