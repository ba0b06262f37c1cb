"""How many intra-op threads each model's worker gets on CPU.

Measured on the 2-core bench machine (cpu-tiny pair, N = 4, delayed): small 1 + large 2 threads
gave 247 tok/s against 199 for 1 + 1 and 190 for 2 + 2. The large model is busy most of the time
and its steps scale with cores; the small one is busy ~20% and its 1-thread steps barely slow
the large one's spinning OpenMP team. So the heaviest model gets every core and the others share.
"""
from __future__ import annotations

import os
from typing import Mapping, Sequence


def plan_threads(weights: Sequence[int], cores: int | None = None) -> list[int]:
    """weights[i]: model i's parameter count (0 for a weightless sim). Returns threads per model."""
    cores = cores or os.cpu_count() or 1
    if not weights:
        return []
    heaviest = max(range(len(weights)), key=lambda i: (weights[i], -i))
    rest = max(1, cores // len(weights))
    return [cores if i == heaviest else rest for i in range(len(weights))]


def resolve_threads(spec: int | Mapping[str, int] | None, names: Sequence[str], weights: Sequence[int]) -> list[int]:
    """`Router(threads=...)`: None plans by weight, an int applies to every model, a dict names models."""
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
