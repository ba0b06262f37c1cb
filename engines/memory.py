"""Joint KV sizing for models that share one device (the paper's Appendix B): give every model
the same token capacity, the largest that fits beside all their weights."""
from __future__ import annotations

from typing import NamedTuple


class ModelFootprint(NamedTuple):
    name: str
    weight_bytes: int
    kv_bytes_per_token: int


def joint_kv_tokens(models: list[ModelFootprint], device_bytes: int, memory_fraction: float = 0.9,
                    reserve_bytes: int = 0, page_size: int = 16) -> int:
    """Largest T (a multiple of page_size) with sum(weights) + T * sum(kv per token) + reserve
    <= memory_fraction * device_bytes. Raises when even the weights do not fit."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    if not models:
        raise ValueError("no models to size")
    budget = int(memory_fraction * device_bytes) - reserve_bytes - sum(m.weight_bytes for m in models)
    per_token = sum(m.kv_bytes_per_token for m in models)
    if budget < per_token * page_size:
        names = ", ".join(m.name for m in models)
        raise ValueError(f"models {names} need {sum(m.weight_bytes for m in models) / 2**30:.2f} GiB of weights; "
                         f"{memory_fraction:.0%} of {device_bytes / 2**30:.2f} GiB leaves no room for one KV page each")
    return budget // per_token // page_size * page_size
