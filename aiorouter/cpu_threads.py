"""How many intra-op threads each model's worker gets on CPU.

Measured on the 2-core bench machine (cpu-tiny pair, N = 4, delayed): small 1 + large 2 threads
gave 247 tok/s against 199 for 1 + 1 and 190 for 2 + 2. The large model is busy most of the time
and its steps scale with cores; the small one is busy ~20% and its 1-thread steps barely slow
the large one's spinning OpenMP team. So the heaviest model gets every core and the others share.
"""
from __future__ import annotations

import functools
import os
import threading
from typing import Callable, Mapping, Sequence, TypeVar

import torch

T = TypeVar("T")


def plan_threads(weights: Sequence[int], cores: int | None = None) -> list[int]:
    """weights[i]: model i's parameter count (0 for a weightless sim). Returns threads per model."""
    cores = cores or os.cpu_count() or 1
    if not weights:
        return []
    heaviest = max(range(len(weights)), key=lambda i: (weights[i], -i))
    rest = max(1, cores // len(weights))
    return [cores if i == heaviest else rest for i in range(len(weights))]


def resolve_threads(spec: int | Mapping[str, int] | None, names: Sequence[str], weights: Sequence[int]) -> list[int]:
    """`RouterConfig(threads=...)`: None plans by weight, an int applies to every model, a dict names models."""
    if spec is None:
        return plan_threads(weights)
    if isinstance(spec, bool) or not isinstance(spec, (int, Mapping)):
        raise ValueError(f"threads must be an int, a dict model->int or None, got {spec!r}")
    if isinstance(spec, int):
        spec = {n: spec for n in names}
    unknown = [k for k in spec if k not in names]
    if unknown:
        raise ValueError(f"threads names unknown model {unknown[0]!r}; models: {', '.join(names)}")
    planned = plan_threads(weights)
    out = [int(spec.get(n, planned[i])) for i, n in enumerate(names)]
    if any(t < 1 for t in out):
        raise ValueError(f"threads must be >= 1, got {dict(zip(names, out))}")
    return out


class CoreShare:
    """Cores lent back and forth between the heaviest model and the others, on one CPU.

    The heaviest model's OpenMP team spans every core; a lighter model's step in another thread
    takes one of them, and every parallel region of the heavy step then waits at its barrier for
    the descheduled team member. So while light steps run, the heavy model shrinks its team,
    between two of its layers, to the cores they leave, and grows it back after. Measured on
    the 2-core bench machine (cpu-tiny, N = 4, eager, where the two overlap most): the large
    step 27.0 -> 24.7 ms, 197 -> 209 tok/s; delayed N = 16 510-524 -> 530-536 tok/s.
    """

    def __init__(self, heavy_threads: int, light: dict[int, int], cores: int | None = None):
        self.heavy_threads = heavy_threads  # the heavy model's planned team
        self.light = light  # model index -> intra-op threads, for every lighter model
        self.cores = cores or os.cpu_count() or 1
        self._lock = threading.Lock()
        self.light_busy = 0  # intra-op threads of light steps in flight
        self._heavy_now = heavy_threads

    @classmethod
    def plan(cls, engines: Sequence[object], threads: Sequence[int]) -> "CoreShare | None":
        """Share when every model runs on this CPU with weights to read (a sim engine sleeps; a GPU
        model's worker only launches kernels). The heavy model's steps run with `heavy_layer` as
        their layer hook (`step_fn`): passed per step, so the engines stay as they were given."""
        if len(engines) < 2 or any(e.num_params == 0 or e.device.type != "cpu" for e in engines):
            return None
        heavy = max(range(len(threads)), key=lambda i: (threads[i], -i))
        return cls(threads[heavy], {i: t for i, t in enumerate(threads) if i != heavy})

    def step_fn(self, index: int, fn: Callable[..., T]) -> Callable[..., T]:
        """Model `index`'s step function as its worker must call it: counted while it runs when
        the model is a light one; for the heavy one, with `heavy_layer` as its layer hook (`fn`
        takes a `layer_hook` keyword: Engine.execute, ModelRunner.run)."""
        return functools.partial(self.run_light, index, fn) if index in self.light else \
            functools.partial(fn, layer_hook=self.heavy_layer)

    def layer_hook(self, index: int) -> Callable[[], None] | None:
        """The layer hook model `index`'s steps run with (only the heavy model has one)."""
        return None if index in self.light else self.heavy_layer

    def run_light(self, index: int, fn: Callable[..., T], *args) -> T:
        """Run a light model's step `fn(*args)` (in its worker thread), its threads counted."""
        with self._lock:
            self.light_busy += self.light[index]
        try:
            return fn(*args)
        finally:
            with self._lock:
                self.light_busy -= self.light[index]

    def heavy_layer(self) -> None:
        """Before each heavy layer, in the heavy worker thread: size its team to the free cores."""
        want = max(1, min(self.heavy_threads, self.cores - self.light_busy))
        if want != self._heavy_now:
            torch.set_num_threads(want)  # per thread in OpenMP: this worker's team only
            self._heavy_now = want
