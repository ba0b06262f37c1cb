"""Weight-only quantized linear layers on torch's packed kernels: `Engine(..., quantization=...)`.

Schemes (what `quantization` names), each a method for the decoder's linears and one for the
output head; the embedding table stays dense (a step reads one row of it per token):
- "int4": asymmetric groups of 32 inputs, GGUF Q4_1's grid (w = q * d + min, q in [0, 15]),
  in torch's tinygemm layout (w = (q - 8) * d + zero, zero = min + 8 d). A Q4_1 GGUF
  de-quantized to floats re-quantizes onto exactly its own grid (SmolLM2: max error 0.0).
  torch's CPU int4 kernel decodes each group again per 4 rows, so at batch 16 it costs as much
  as fp32; steps of more rows take another path. Where the CPU has AMX-BF16, it is the
  project's AMX kernel on a second packing of the same codes (engines/csrc/int4_linear_cpu.cpp,
  1.375 bytes per weight in all): 9 against fp32's 51 ms for a SmolLM2 step's decoder linears at
  16 rows, 1 thread. Elsewhere it is a bf16 copy of the same weights in oneDNN (2.5 bytes per
  weight), where oneDNN has bf16. int8 activations (fbgemm's VNNI GEMM) were tried for those
  rows and dropped: greedy top-1 agreement with the fp32 model fell from 97.6% to 83%
  (bench/RESULTS.md, "The default pair").
- "int8": symmetric, one scale per output channel.
The head is W8A8 on CPU (int8 weights per channel, int8 activations per token, torch._int_mm)
in both: SmolLM2's head is Q8_0 in its GGUF, off any 4-bit grid (an int4 head dropped greedy
top-1 agreement with the fp32 model from 98.9% to 88%; W8A8 keeps 97.6%), and the weight-only
int8 kernel re-reads the weight per 4 rows (3x the fp32 head at 16 tokens, W8A8 0.4x).

The kernels take bfloat16 activations: their float32 and (on x86) float16 paths are scalar
loops, 15-80x slower than the fp32 oneDNN Linear they replace. So a quantized linear casts its
input to bfloat16 and its output back. Kernel limits (torch 2.13) are checked up front, because
the CPU int8 kernel does not raise on a K it cannot take: its AVX-512 loop segfaults.
- int4 CPU: N % 16 == 0, K % group == 0 (group 32, 64, 128 or 256). CUDA: N % 8, K % 32.
- int8 CPU: K % 16 == 0, rows 32-byte aligned. CUDA: refused (torch's kernel is a naive loop).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from engines import cpu_kernels
from engines.moe import Experts
from engines.onednn_rows import ONEDNN_LINEAR, packed_linear
from engines.quant_formats import (
    COMPUTE_DTYPE,
    check_shape,
    dequantize_int4,
    int4_cuda_bytes,
    int4_inner_k_tiles,
    int4_scales_and_zeros,
    pack_int4_bf16dot,
    quantize_int4,
    quantize_int8,
)

# scheme -> (method for decoder linears, method for the output head; None keeps it dense)
SCHEMES: dict[str, tuple[str, str | None]] = {"int4": ("int4", "w8a8"), "int8": ("int8", "w8a8")}
QUANTIZATIONS = tuple(SCHEMES)
CONFIG_KEY = "aiorouter_quantization"  # config.json key of a checkpoint that asks to be loaded quantized
_aten = torch.ops.aten
# Above this many rows an int4 CPU layer leaves torch's int4 kernel for its many-row path. At 1
# row a step is memory-bound and torch's kernel reads a quarter of bf16's bytes; with more rows it
# turns compute-bound, and, decoding each weight group again per 4 rows, falls behind. A SmolLM2
# step's decoder linears, 1 thread (`python -m bench.default_pair kernels`):
# - the bf16 copy in oneDNN (AVX512-BF16, no AMX; busy machine): torch int4 / bf16 = 11 / 60 ms at
#   1 row, 45 / 72 at 4, 81 / 72 at 8, 148 / 96 at 16 (fp32: 103 at 1, 149 at 16): INT4_MAX_ROWS;
# - the AMX kernel (Sapphire Rapids): torch int4 / AMX = 6.5 / 9.2 ms at 1 row, 7.9 / 9.2 at 2,
#   9.5 / 9.5 at 3, 11.1 / 9.8 at 4, 40.5 / 9.0 at 16: INT4_AMX_MAX_ROWS.
INT4_MAX_ROWS = 6
INT4_AMX_MAX_ROWS = 2


def check_quantization(quantization: str | None) -> str | None:
    if quantization is None or quantization in SCHEMES:
        return quantization
    raise ValueError(f"unknown quantization {quantization!r}; use one of {', '.join(SCHEMES)} or None")


def declared_quantization(path: str | Path) -> str | None:
    """The scheme a checkpoint's config.json asks for under CONFIG_KEY (None: dense)."""
    cfg = Path(path) / "config.json"
    raw = json.loads(cfg.read_text()).get(CONFIG_KEY) if cfg.is_file() else None
    try:
        return check_quantization(raw)
    except ValueError as e:
        raise ValueError(f"{cfg}: {CONFIG_KEY}: {e}") from None


class QuantLinear(nn.Module):
    """A linear layer with an int4 / int8 weight packed once for its device's kernel.

    Inference only: x [T, in] -> [T, out] in x's dtype. The dense weight is not kept. It cannot
    move to another device or dtype afterwards (the packed layout is the device's own).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, method: str, group_size: int = 32):
        super().__init__()
        N, K = weight.shape
        dev = weight.device
        check_shape(method, N, K, dev, group_size)
        self.method, self.group_size, self.in_features, self.out_features = method, group_size, K, N
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # int4 on CPU, for more than `kernel_rows` rows: the AMX kernel's packing of the codes
        # (codes, block_scales), else a bf16 oneDNN-packed copy (wide), else neither
        self.wide: torch.Tensor | None = None
        self.codes: torch.Tensor | None = None
        self.block_scales: torch.Tensor | None = None
        self.kernel_rows = INT4_MAX_ROWS
        if method == "int4":
            q, scale, zero = quantize_int4(weight, group_size)
            if dev.type == "cuda":
                packed = _aten._convert_weight_to_int4pack(int4_cuda_bytes(q), int4_inner_k_tiles(K))
            else:
                packed = _aten._convert_weight_to_int4pack_for_cpu(q, 2)  # [N, K/2] uint8, blocked
            self.register_buffer("qweight", packed)
            self.register_buffer("scales", int4_scales_and_zeros(scale, zero))  # [K/g, N, 2] bf16
            if dev.type == "cpu" and cpu_kernels.int4_amx_available():  # the same codes, bf16 scales and zeros
                self.codes, self.block_scales = pack_int4_bf16dot(q, scale, zero)
                self.kernel_rows = INT4_AMX_MAX_ROWS
            elif dev.type == "cpu":  # the same weights, as the kernel reads them (bf16 scales and zeros)
                self.wide = _packed_bf16(dequantize_int4(q, scale.to(COMPUTE_DTYPE), zero.to(COMPUTE_DTYPE)))
        else:
            q, s = quantize_int8(weight)
            # int8 reads [N, K] rows; _int_mm takes [K, N], and the transposed view is what oneDNN wants
            # (except at K = 1, where torch 2.13's _int_mm misreads that view's strides: wrong sums)
            self.register_buffer("qweight", q if method == "int8" else q.t() if K > 1 else q.reshape(1, N))
            self.register_buffer("scales", s.to(COMPUTE_DTYPE) if method == "int8" else s)  # [N]
        self._placed = (self.qweight.device, self.scales.dtype)

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        if (self.qweight.device, self.scales.dtype) != self._placed:
            raise ValueError(f"a {self.method} QuantLinear is packed for {self._placed[0]} and cannot be moved or "
                             "cast; quantize the model where it runs (device groups do not take quantized models)")
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, in] -> [T, out]
        if self.method == "w8a8":  # int8 activations, one scale per token
            xf = x.float()
            xs = xf.abs().amax(-1, keepdim=True).clamp_min_(1e-12).div_(127)  # [T, 1]
            acc = torch._int_mm(xf.div(xs).round_().to(torch.int8), self.qweight)  # [T, N] int32, exact
            out = acc.float().mul_(xs).mul_(self.scales).to(x.dtype)
        elif self.codes is not None and x.shape[0] > self.kernel_rows:  # [T, in] fp32 -> [T, out] fp32
            a = x if x.dtype in (torch.float32, COMPUTE_DTYPE) else x.float()
            out = torch.ops.aiorouter_cpu.int4_linear(a.contiguous(), self.codes, self.block_scales,
                                                      self.group_size).to(x.dtype)
        elif self.wide is not None and x.shape[0] > self.kernel_rows:
            out = packed_linear(x.to(COMPUTE_DTYPE), self.wide, None).to(x.dtype)
        else:
            a = x.to(COMPUTE_DTYPE)
            if not a.is_contiguous() or a.data_ptr() % 64:  # the kernels load whole aligned rows
                a = a.clone(memory_format=torch.contiguous_format)
            if self.method == "int8":
                out = _aten._weight_int8pack_mm(a, self.qweight, self.scales)
            elif a.is_cuda:
                out = _aten._weight_int4pack_mm(a, self.qweight, self.group_size, self.scales)
            else:
                out = _aten._weight_int4pack_mm_for_cpu(a, self.qweight, self.group_size, self.scales)
            out = out.to(x.dtype)
        return out + self.bias if self.bias is not None else out

    @property
    def many_rows(self) -> str | None:
        """What runs steps of more than `kernel_rows` rows: "amx", "bf16" (oneDNN) or None (torch's kernel)."""
        return "amx" if self.codes is not None else "bf16" if self.wide is not None else None

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.method == "int4" else ""
        m = f", above {self.kernel_rows} rows {self.many_rows}" if self.many_rows else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.method}{g}{m}"


def _packed_bf16(w: torch.Tensor) -> torch.Tensor | None:
    """w [N, K] -> w rounded to bf16 in oneDNN's blocked layout; None where oneDNN has no bf16
    (the int4 kernel then takes every row count)."""
    if ONEDNN_LINEAR is None or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w.to(COMPUTE_DTYPE).contiguous(), None)


def quantize_model(model: nn.Module, scheme: str, group_size: int = 32) -> int:
    """Replace the linear layers (`nn.Linear`, as `engines.model.Linear` is) and the MoE experts of
    a loaded model by QuantLinears, in place on the weights' device, as `scheme` says (SCHEMES). A
    tied head gets its own quantized copy; the embedding and MoE routers (DenseGate) keep dense
    weights. Returns how many were quantized."""
    body, head = SCHEMES[check_quantization(scheme)]
    dev = next(model.parameters()).device
    if dev.type == "cuda" and head == "w8a8":
        head = None  # torch._int_mm needs > 16 rows there; the head stays dense (bf16 on GPUs)
    n = 0
    for name, lin in [(n_, m) for n_, m in model.named_modules() if isinstance(m, nn.Linear)]:
        method = head if name == "lm_head" else body
        if method is None:
            continue
        parent, _, attr = name.rpartition(".")
        try:
            q = QuantLinear(lin.weight, lin.bias, method, group_size)
        except ValueError as e:
            raise ValueError(f"cannot quantize {name} [{lin.out_features}, {lin.in_features}] to {scheme}: {e}") from None
        setattr(model.get_submodule(parent) if parent else model, attr, q)
        n += 1
    for name, experts in [(n_, m) for n_, m in model.named_modules() if isinstance(m, Experts)]:
        try:  # sparse layers' stacked experts: a QuantLinear per expert and projection
            n += experts.quantize(lambda w: QuantLinear(w, None, body, group_size))
        except ValueError as e:
            raise ValueError(f"cannot quantize {name} to {scheme}: {e}") from None
    return n
