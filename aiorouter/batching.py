"""Delayed batching: when an idle model may launch its next step."""
from __future__ import annotations

from typing import Mapping

Thresholds = Mapping[int, tuple[int, ...]]  # concurrency N -> B per model


def parse_thresholds(spec: object, names: list[str], max_concurrency: int) -> dict[int, tuple[int, ...]] | None:
    """A dict model -> B (any concurrency) or N -> {model: B}; None means "ask the tuner"."""
    if spec in ("auto", None):
        return None
    if not isinstance(spec, Mapping) or not spec:
        raise ValueError(f"thresholds must be 'auto', a dict model->B, or a dict N->{{model: B}}; got {spec!r}")

    def vector(d: Mapping) -> tuple[int, ...]:
        unknown = [k for k in d if k not in names]
        if unknown:
            raise ValueError(f"thresholds name unknown model {unknown[0]!r}; models: {', '.join(names)}")
        b = tuple(int(d.get(n, 1)) for n in names)
        if any(x < 1 for x in b):
            raise ValueError(f"thresholds must be >= 1, got {dict(zip(names, b))}")
        return b

    if all(isinstance(k, str) for k in spec):
        b = vector(spec)
        return {n: b for n in range(1, max_concurrency + 1)}
    if all(isinstance(k, int) for k in spec):
        table = {int(n): vector(d) for n, d in spec.items()}
        return {n: table[max([k for k in table if k <= n], default=min(table))] for n in range(1, max_concurrency + 1)}
    raise ValueError("thresholds keys must be all model names or all concurrency levels")


def should_launch(ready: int, threshold: int, num_active: int) -> bool:
    """Launch at `threshold` ready requests, or when every active request is already here:
    then nothing else can arrive, and waiting would deadlock."""
    return ready > 0 and (ready >= threshold or ready >= num_active)
