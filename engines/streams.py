"""CUDA streams that belong to one model each, made by a factory the process passes around.

`torch.cuda.Stream()` does not make a stream: it hands out one of 32 pooled streams per device
and priority, round-robin, so the 33rd call returns the first again. Two models' runners (or a
runner and another model's graph captures) could then share one stream: their kernels would
serialise instead of overlapping, and graphs captured on it would share its cuBLAS workspace
and race when replayed on two streams at once. `StreamFactory` makes new streams
(cudaStreamCreate) and refuses to hand a stream to a second owner, so every stream a runner
holds is provably its own. There is one factory per router (or per engine built alone): it is
passed in, never a module global.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable, NamedTuple

import torch

# device -> (a new stream on it: anything with `.cuda_stream`, the raw handle, and `.device`; or
# None where the device has no streams, the CPU) and how it was made, for the record
StreamCreator = Callable[[torch.device], tuple[Any, str]]


class StreamRecord(NamedTuple):
    owner: str
    device: str
    handle: int
    how: str  # which call made it (see new_cuda_stream)


def new_cuda_stream(device: torch.device) -> tuple[torch.cuda.ExternalStream | None, str]:
    """(a stream made for the caller alone on `device`, how); None for a CPU device (nothing to order).

    Non-blocking (CU_STREAM_NON_BLOCKING) through cuda-python's driver bindings where they are
    installed (the CUDA image of the device machine has them): work that anything else queues on
    the legacy default stream (a policy network, a stray copy) then does not stall every model.
    Otherwise torch's own binding of cudaStreamCreate, a blocking stream, which does wait for the
    legacy default stream. `how` says which one ran (and why not the first)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, "cpu: no streams"
    with torch.cuda.device(device):
        # a runtime call on the device: its context is now current on this thread (cuStreamCreate
        # makes the stream in the current context)
        torch.cuda.current_stream(device).synchronize()
        handle, how = _create_non_blocking()
        if handle is None:
            handle, why = _create_blocking()
            how = f"{why}; non-blocking unavailable: {how}"
    return torch.cuda.ExternalStream(handle, device=device), how


def _create_non_blocking() -> tuple[int | None, str]:
    try:
        from cuda.bindings import driver
    except ImportError:
        return None, "cuda-python not installed"
    try:  # (bindings of another version may differ: any failure leaves the blocking stream)
        err, stream = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None, f"cuStreamCreate failed: {err!r}"
        return int(stream), "cuStreamCreate(CU_STREAM_NON_BLOCKING)"
    except Exception as e:  # noqa: BLE001
        return None, f"cuda-python: {e!r}"


def _create_blocking() -> tuple[int, str]:
    cudart = torch.cuda.cudart()
    handle = ctypes.c_void_p()
    err = cudart.cudaStreamCreate(ctypes.addressof(handle))
    if err != cudart.cudaError.success:
        raise RuntimeError(f"cudaStreamCreate failed: {cudart.cudaGetErrorString(err)}")
    return handle.value, "cudaStreamCreate (blocking)"


class StreamFactory:
    """Hands out streams, each to one owner only. `create` makes a stream for a device (default:
    `new_cuda_stream`); tests pass their own to check ownership without a GPU. Thread-safe: a
    router builds its engines in worker threads."""

    def __init__(self, create: StreamCreator = new_cuda_stream):
        self._create = create
        self._lock = threading.Lock()
        self._records: dict[tuple[str, int], StreamRecord] = {}

    def stream(self, device: torch.device, owner: str):
        """A stream on `device` that no other owner got from this factory (None on CPU)."""
        s, how = self._create(torch.device(device))
        if s is None:
            return None
        key = (str(device), int(s.cuda_stream))
        with self._lock:
            held = self._records.get(key)
            if held is not None:
                raise RuntimeError(f"stream {key[1]:#x} on {device} is {held.owner}'s already; {owner} would share "
                                   "it (their kernels would serialise, and graphs captured on it would share one "
                                   "cuBLAS workspace). The stream creator must make a new stream per call.")
            self._records[key] = StreamRecord(owner, str(device), key[1], how)
        return s

    def owner_of(self, stream) -> str | None:
        """Who holds `stream` (None: not from this factory)."""
        if stream is None:
            return None
        rec = self._records.get((str(stream.device), int(stream.cuda_stream)))
        return rec.owner if rec else None

    def records(self) -> list[StreamRecord]:
        with self._lock:
            return list(self._records.values())
