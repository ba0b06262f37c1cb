"""The start-up heap out of Python's cyclic GC while anything serves.

Weights' modules, tokenizers and torch's and transformers' imports are ~370k GC-tracked objects
that live as long as the process. Each full collection walked them all while holding the GIL,
stalling every model's worker between kernels: freezing them made the cpu-tiny pair serve 15%
more tokens/s at N = 4 (vLLM freezes its heap after start-up for the same reason). Objects made
later (requests, events) are collected as usual.

`gc.freeze` is process-wide, and the GC itself says whether the heap is frozen
(`gc.get_freeze_count`), so this module keeps no state of its own: a `FrozenHeap` is one holder's
claim, and the holder that froze the heap unfreezes it when it lets go, so a closed router's
cycles can be collected. A holder that finds the heap frozen already (another router's, or the
application's own `gc.freeze`) freezes and unfreezes nothing. Two routers that overlap in one
process lose the freeze when the first one closes: a cost in GC pauses, never in what is kept.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


class FrozenHeap:
    """One holder's claim on the frozen heap (`hold`); `release` lets go, once."""

    def __init__(self, froze: bool):
        self._froze = froze  # this holder froze the heap, so it unfreezes it

    @classmethod
    def hold(cls) -> "FrozenHeap":
        if gc.get_freeze_count() > 0:
            return cls(froze=False)
        gc.collect()
        gc.freeze()
        return cls(froze=True)

    def release(self) -> None:
        if self._froze:
            self._froze = False
            gc.unfreeze()


@contextlib.contextmanager
def frozen() -> Iterator[FrozenHeap]:
    claim = FrozenHeap.hold()
    try:
        yield claim
    finally:
        claim.release()
