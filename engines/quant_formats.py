"""The numeric formats behind engines/quant.py and the layouts torch's kernels read.

Pure tensor functions, testable on any machine (the CUDA layouts included): quantize and
de-quantize, the tinygemm scale/zero layout, CUDA's nibble order, and each kernel's shape limits.
"""
from __future__ import annotations

import torch

INT4_GROUP_SIZES = (32, 64, 128, 256)
COMPUTE_DTYPE = torch.bfloat16  # the activation dtype of the int4 / int8 kernels (see quant.py)


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] int32 in [0, 15], scale [N, K/g], zero [N, K/g]) fp32, with
    w ~= (q - 8) * scale + zero per group of g inputs (min/max, as Q4_1)."""
    N, K = w.shape
    if group_size not in INT4_GROUP_SIZES or K % group_size:
        raise ValueError(f"int4: in_features {K} must be a multiple of group_size {group_size} "
                         f"(one of {INT4_GROUP_SIZES})")
    g = w.detach().float().reshape(N, K // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)  # [N, K/g]
    d = (hi - lo) / 15
    d = torch.where(d > 0, d, torch.ones_like(d))  # a constant group: q = 0 is exact for any scale
    q = ((g - lo[..., None]) / d[..., None]).round_().clamp_(0, 15).to(torch.int32).reshape(N, K)
    return q, d, lo + 8 * d


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_int4 -> w [N, K] fp32."""
    g = q.shape[1] // scale.shape[1]
    return (q.float() - 8) * scale.float().repeat_interleave(g, 1) + zero.float().repeat_interleave(g, 1)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] int8, scale [N] fp32), w ~= q * scale (absmax per output channel)."""
    w = w.detach().float()
    s = w.abs().amax(1) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (w / s[:, None]).round_().clamp_(-127, 127).to(torch.int8), s


def int4_scales_and_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """scale, zero [N, K/g] -> [K/g, N, 2] bf16, the layout both int4 kernels read."""
    return torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(COMPUTE_DTYPE)


def int4_cuda_bytes(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in [0, 15] -> [N, K/2] uint8, even k in the high nibble: what CUDA's
    `_convert_weight_to_int4pack` tiles for mma (on the device)."""
    return ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)


def int4_inner_k_tiles(K: int) -> int:
    """The widest CUDA inner k-tiling (8, 4 or 2 tiles of 16 inputs) that divides K."""
    for t in (8, 4, 2):
        if K % (16 * t) == 0:
            return t
    raise ValueError(f"int4 on CUDA needs in_features % 32 == 0, got {K}")


def check_shape(method: str, N: int, K: int, device: torch.device, group_size: int = 32) -> None:
    """ValueError unless the `method` kernel on `device` takes a weight [N out, K in]."""
    cuda = device.type == "cuda"
    if method == "int4":
        n_mult, k_mult = (8, max(32, group_size)) if cuda else (16, group_size)
        if group_size not in INT4_GROUP_SIZES or N % n_mult or K % k_mult:
            raise ValueError(f"int4 on {device.type} needs group_size in {INT4_GROUP_SIZES}, out_features % "
                             f"{n_mult} == 0 and in_features % {k_mult} == 0; got [{N}, {K}], group {group_size}")
    elif method == "int8":
        if cuda:
            raise ValueError("int8 weight-only has no usable CUDA kernel in torch (its _weight_int8pack_mm "
                             "is one thread per output); use int4 on CUDA")
        if K % 16:
            raise ValueError(f"int8 needs in_features % 16 == 0 (its kernel reads 16 at a time); got [{N}, {K}]")
    elif method == "w8a8":
        if cuda:
            raise ValueError("w8a8 (torch._int_mm) needs more than 16 rows on CUDA; keep the layer dense there")
    else:
        raise ValueError(f"unknown quantized linear method {method!r}; use int4, int8 or w8a8")


def pack_int4_bf16dot(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] in [0, 15], scale and zero [N, K/g] -> (codes [N/16, K/2, 16] uint8, scales
    [N/16, K/g, 4, 16] bf16): the layout engines/csrc/int4_linear_cpu.cpp reads.

    A row of an AMX B tile for `tdpbf16ps` is 16 outputs x 2 inputs: bf16 elements 2j and 2j+1 are
    output j's weights at inputs 2p and 2p+1. The kernel decodes 16 codes into the 16 fp32 lanes
    of w_lo and 16 into w_hi, and packs both into one row with `vcvtne2ps2bf16` (elements 0-15
    from w_lo, 16-31 from w_hi). So lane i of w_lo is output i // 2 of the block at input
    2p + i % 2, and lane i of w_hi output 8 + i // 2: byte i of (block b, input pair p) =
    q[16b + i//2, 2p + i%2] | q[16b + 8 + i//2, 2p + i%2] << 4. The scales follow the same
    lanes: [b, g, 0] = d of w_lo's lanes, [1] = d of w_hi's, [2] and [3] the zeros."""
    N, K = q.shape
    G = scale.shape[1]
    if N % 16 or K % 2 or scale.shape != (N, G) or zero.shape != (N, G):
        raise ValueError(f"pack_int4_bf16dot: q [{N}, {K}] needs N % 16 == 0 and K even, scales [N, K/g]; "
                         f"got scale {tuple(scale.shape)}, zero {tuple(zero.shape)}")
    # [N/16, half (lo, hi), 8 outputs, K/2 pairs, 2] -> [N/16, K/2, half, 16 lanes]
    lanes = q.to(torch.uint8).reshape(N // 16, 2, 8, K // 2, 2).permute(0, 3, 1, 2, 4).reshape(N // 16, K // 2, 2, 16)
    codes = (lanes[:, :, 0] | (lanes[:, :, 1] << 4)).contiguous()

    def by_lane(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [N/16, G, 2 halves, 16 lanes]
        return t.reshape(N // 16, 2, 8, 1, G).expand(-1, -1, -1, 2, -1).permute(0, 4, 1, 2, 3).reshape(N // 16, G, 2, 16)

    scales = torch.cat([by_lane(scale), by_lane(zero)], 2).to(COMPUTE_DTYPE).contiguous()
    return codes, scales
