"""Which attention backend a device gets. Backends are imported only when picked: flashinfer and
triton import on CPU machines too, but none of their kernels run there."""
from __future__ import annotations

import importlib.util
import os

import torch

from engines.attention.base import AttentionBackend

BACKENDS = ("flashinfer", "triton", "torch")  # preference order on CUDA; CPU: "cpu", else "torch"


def has_module(module: str) -> bool:
    """Is `module` installed? (Found, not imported: importing flashinfer costs seconds.)"""
    return importlib.util.find_spec(module) is not None


def select_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """Pick by device, never by a successful import. On CUDA the first installed of BACKENDS; on CPU
    the kernel backend (cpu_backend.py) when it builds, else torch. `name` forces one ("torch" works
    everywhere, "cpu" on CPU, the others need CUDA; "triton" also runs on CPU under the Triton
    interpreter, TRITON_INTERPRET=1, which only tests and dry runs want)."""
    device = torch.device(device)
    if name is None:
        if device.type == "cuda" and torch.cuda.is_available():
            name = next(b for b in BACKENDS if b == "torch" or has_module(b))
        elif device.type == "cpu":
            from engines.attention.cpu_backend import CpuBackend, load
            op = load()  # None (and one warning) when the kernel cannot be built here
            if op is not None:
                return CpuBackend(op)
            name = "torch"
        else:
            name = "torch"
    if name == "torch":
        from engines.attention.torch_backend import TorchBackend
        return TorchBackend()
    if name == "cpu":
        from engines.attention.cpu_backend import CpuBackend, load
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on CPU tensors only, got {device}")
        op = load()
        if op is None:
            raise RuntimeError("attention backend 'cpu': its kernel could not be built here (see the warning above)")
        return CpuBackend(op)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: torch, cpu (CPU kernel), "
                         "triton (CUDA), flashinfer (CUDA)")
    interpreted = name == "triton" and os.environ.get("TRITON_INTERPRET") == "1"  # CPU tests, dry runs
    if device.type != "cuda" and not interpreted:
        raise ValueError(f"attention backend {name!r} needs a CUDA device, got {device}")
    if name == "triton":
        from engines.attention.triton_backend import TritonBackend
        return TritonBackend()
    from engines.attention.flashinfer_backend import FlashInferBackend
    return FlashInferBackend(device)
