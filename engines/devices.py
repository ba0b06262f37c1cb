"""Device groups: `"cuda:0,1"` splits a model's layers across GPUs (an in-process pipeline); each
stage keeps the KV of its own layers on its own device. Pure bookkeeping, tested on CPU with a
group of two "cpu" devices (tests/test_gpu_parts_cpu.py); real cross-GPU copies have not run."""
from __future__ import annotations

from typing import NamedTuple

import torch


def parse_devices(spec: str | torch.device | None) -> list[torch.device]:
    """"cpu" | "cuda:0" | "cuda:0,1" | "cuda:0,cuda:1" -> one device per pipeline stage. A
    repeated GPU is refused (two stages would share its memory for nothing); a repeated "cpu"
    is allowed, which is how the split is tested without GPUs."""
    if spec is None or isinstance(spec, torch.device):
        return [torch.device(spec or "cpu")]
    parts = [p.strip() for p in str(spec).split(",")]
    if not all(parts):
        raise ValueError(f"bad device group {spec!r}: an empty entry")
    devices, kind = [], None
    for p in parts:
        if p.isdigit():  # "cuda:0,1": bare indices continue the first entry's type
            if kind is None:
                raise ValueError(f"bad device group {spec!r}: starts with a bare index")
            p = f"{kind}:{p}"
        try:
            d = torch.device(p)
        except RuntimeError:
            raise ValueError(f"bad device group {spec!r}: {p!r} is not a device") from None
        kind = d.type
        devices.append(d)
    if len({d.type for d in devices}) > 1:
        raise ValueError(f"bad device group {spec!r}: mixes device types")
    gpus = [d for d in devices if d.type != "cpu"]
    if len(gpus) != len(set(gpus)):
        raise ValueError(f"bad device group {spec!r}: a device appears twice")
    return devices


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges, as even as possible (earlier stages take the remainder: the last
    one also holds the final norm and lm_head)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for i in range(num_stages):
        n = base + (i < extra)
        out.append(range(start, start + n))
        start += n
    return out


class LayerSlice:
    """A stage's [num_stage_layers, ...] KV tensor indexed by global layer id (what Attention uses)."""

    def __init__(self, t: torch.Tensor, first: int):
        self.t, self.first = t, first

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.t[layer - self.first]


class StageKV(NamedTuple):
    k: LayerSlice
    v: LayerSlice


def host_tensor(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without a stream sync: pinned + non_blocking on CUDA (a
    pageable copy makes torch wait for the stream), plain on CPU."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
