"""Row buckets for oneDNN calls on CPU (engines/model.Linear, engines/quant.QuantLinear)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def bucket_rows(t: int) -> int:
    """The row count a oneDNN call on `t` rows runs at: t itself up to 32 (decode batches), then
    the next power of two up to 256, then the next multiple of 256.

    oneDNN builds (JIT-compiles) a primitive per input shape and caches up to 1024 of them
    (ONEDNN_PRIMITIVE_CACHE_CAPACITY). Prefill chunks of every prompt length made a new shape each,
    so a serving process's RSS climbed for as long as new lengths arrived: +9-14 % over a 2-minute
    soak of the cpu-tiny pair (bench/soak.py), and -9 % with the cache capped at 8 entries. With
    buckets a model has at most 32 + 2 + max_chunk / 256 row counts per weight shape; the padding
    costs at most 2x on a prompt of 33-256 tokens and < 256 rows above."""
    if t <= 32:
        return t
    if t <= 256:
        return 1 << (t - 1).bit_length()
    return -(-t // 256) * 256


def onednn_rows(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn(x) for a oneDNN call, run at `bucket_rows` rows: x [T, in] -> [T, out]."""
    t = x.shape[0]
    b = bucket_rows(t) if x.dim() == 2 else t
    if b == t:
        return fn(x)
    return fn(F.pad(x, (0, 0, 0, b - t)))[:t]  # [b, in] -> [b, out] -> [T, out]
