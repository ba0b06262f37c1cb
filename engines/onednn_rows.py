"""Row buckets for oneDNN calls on CPU (engines/model.Linear, engines/quant.QuantLinear)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# oneDNN linear on a pre-packed weight (what inductor's CPU freezing pass emits); None if absent
ONEDNN_LINEAR = getattr(getattr(torch.ops.mkldnn, "_linear_pointwise", None), "default", None)
EXACT_ROWS = 32  # decode batches and short extends run at their own row count
STEPS_PER_OCTAVE = 8  # above that, buckets split each doubling into 8: at most 12.5% padded rows


def bucket_rows(t: int) -> int:
    """The row count a oneDNN call on `t` rows runs at: t itself up to 32, then t rounded up to a
    multiple of 1/8 of its power-of-two octave (33-64 by 4, 65-128 by 8, 129-256 by 16, ...).

    oneDNN builds (JIT-compiles) a primitive per input shape and caches up to 1024 of them
    (ONEDNN_PRIMITIVE_CACHE_CAPACITY). Prefill chunks of every prompt length made a new shape each,
    so a serving process's RSS climbed for as long as new lengths arrived: +9-14 % over a 2-minute
    soak of the cpu-tiny pair (bench/soak.py), and -9 % with the cache capped at 8 entries.
    Buckets bound the shapes per weight (32 + 8 per doubling: 80 up to 2048 rows). They were first
    powers of two, which padded a prompt of 100 tokens to 128 and one of 130 to 256: prefill is
    compute-bound, so it cost as much (the cpu-tiny large model's prefill of 100 tokens took 400
    against 311 ms unpadded, 1 thread) and took sync and eager at N = 4 to 0.77x of the pre-redesign
    runtime in the modes A/B, where every hand-off makes the large model prefill the prompt."""
    if t <= EXACT_ROWS:
        return t
    step = max(1, (1 << ((t - 1).bit_length() - 1)) // STEPS_PER_OCTAVE)
    return -(-t // step) * step


def onednn_rows(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn(x) for a oneDNN call, run at `bucket_rows` rows: x [T, in] -> [T, out]."""
    t = x.shape[0]
    b = bucket_rows(t) if x.dim() == 2 else t
    if b == t:
        return fn(x)
    return fn(F.pad(x, (0, 0, 0, b - t)))[:t]  # [b, in] -> [b, out] -> [T, out]


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] -> [T, out] on a oneDNN-packed weight, at `bucket_rows` rows. Decode steps
    (T <= EXACT_ROWS) call the op directly: the bucketing closure, built per call, was 3.5 us of
    each of a cpu-tiny small model's 17 linears a step, 2 % of its 2.6 ms decode step (cProfile)."""
    if x.shape[0] <= EXACT_ROWS:
        return ONEDNN_LINEAR(x, packed, bias, "none", [], "")
    return onednn_rows(x, lambda v: ONEDNN_LINEAR(v, packed, bias, "none", [], ""))
