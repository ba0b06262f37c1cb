"""torch's weight-only int4 / int8 CPU kernels (engines/quant.py) against the oneDNN-packed fp32
Linear (engines/model.Linear), on SmolLM2-135M's layer shapes, at 1, 2, 3, 4, 8 and 16 rows, 1 thread.

Each layer is built in enough copies to pass 64 MB of fp32 weights and the calls cycle through
them, so no weight is in cache when it is read, as in a decode step of the whole model. Total =
30 layers of each decoder shape plus the head, per step. Methods: fp32 (oneDNN, packed); int4
(QuantLinear: torch's kernel up to its kernel_rows, the AMX kernel or bf16 copy above); int4-kernel
(`_weight_int4pack_mm_for_cpu` alone, bf16 activations, groups of 32); int4-amx (the project's
AMX kernel alone, engines/csrc/int4_linear_cpu.cpp; where the CPU has AMX-BF16); bf16 (the oneDNN-packed
bf16 Linear: what AVX512-BF16 dot products cost, the floor of a weight-only kernel whose
activations stay 16-bit); int8 (`_weight_int8pack_mm`, bf16 activations); w8a8 (`torch._int_mm`,
int8 activations per token); int4 on fp32 activations, the kernel's scalar path, at 1 row only;
and, not used by the engine, fbgemm (torch's dynamic int8
linear, VNNI, the rows scaled to [-1, 1] first so its one input scale acts per token: the cheapest
int8 GEMM torch has on CPU, but int8 activations cost SmolLM2 agreement, bench/RESULTS.md).

    python bench/quant_kernels.py [--reps 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import OutsideLoad, write_json
from engines import cpu_kernels
from engines.model import Linear
from engines.quant import QuantLinear
from engines.quant_formats import quantize_int8

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}  # [out, in]
PER_STEP = {"qkv_proj": 30, "o_proj": 30, "gate_up_proj": 30, "down_proj": 30, "lm_head": 1}


class _Int4Kernel(torch.nn.Module):
    """The int4 kernel alone at every row count (QuantLinear hands more than INT4_MAX_ROWS rows to
    its bf16 copy), on bf16 activations, or on fp32 ones and scales (what a float32 model would
    hand it: the kernel's scalar path)."""

    def __init__(self, q: QuantLinear, fp32: bool):
        super().__init__()
        self.q, self.fp32, self.sz = q, fp32, q.scales.float() if fp32 else q.scales

    def forward(self, x):
        a = x if self.fp32 else x.to(torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(a, self.q.qweight, self.q.group_size, self.sz).float()


class _Int4Amx(torch.nn.Module):
    """The AMX int4 kernel (engines/csrc/int4_linear_cpu.cpp) alone at every row count
    (QuantLinear hands it more than INT4_AMX_MAX_ROWS rows)."""

    def __init__(self, q: QuantLinear):
        super().__init__()
        if q.codes is None:
            raise RuntimeError("this CPU (or build) has no AMX int4 kernel")
        self.q = q

    def forward(self, x):  # x [T, in] fp32 -> [T, out] fp32
        return torch.ops.aiorouter_cpu.int4_linear(x, self.q.codes, self.q.block_scales, self.q.group_size)


class _Bf16(torch.nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.lin = Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        self.lin.weight.data.copy_(w)
        if not self.lin.pack():
            raise RuntimeError("oneDNN cannot pack a bf16 weight on this CPU")

    def forward(self, x):  # x [T, in] fp32 -> [T, out] fp32
        return self.lin(x.to(torch.bfloat16)).float()


class _Fbgemm(torch.nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        q, s = quantize_int8(w)
        with warnings.catch_warnings():  # torch 2.13 warns that quantized tensors are deprecated
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(q, s.double(), torch.zeros(len(s), dtype=torch.long), 0)
            self.packed = torch.ops.quantized.linear_prepack(qw, None)

    def forward(self, x):  # x [T, in] -> [T, out]
        xs = x.abs().amax(-1, keepdim=True).clamp_min_(1e-12)  # [T, 1]
        return torch.ops.quantized.linear_dynamic(x / xs, self.packed, True).mul_(xs)


def layers(method: str, N: int, K: int, copies: int) -> list[torch.nn.Module]:
    out = []
    for i in range(copies):
        w = torch.randn(N, K, generator=torch.Generator().manual_seed(i)) * 0.05
        if method == "fp32":
            lin = Linear(K, N, bias=False)
            lin.weight.data.copy_(w)
            lin.pack()
            out.append(lin)
        elif method in ("bf16", "fbgemm"):
            out.append(_Bf16(w) if method == "bf16" else _Fbgemm(w))
        else:
            q = QuantLinear(w, None, "int4" if method.startswith("int4") else method)
            out.append(_Int4Amx(q) if method == "int4-amx" else
                       _Int4Kernel(q, method == "int4-fp32act") if method.startswith("int4-") else q)
    return out


@torch.inference_mode()
def time_us(mods: list[torch.nn.Module], x: torch.Tensor, reps: int) -> float:
    for m in mods:
        m(x)
    best = []
    for _ in range(reps):
        t = time.perf_counter()
        for m in mods:
            m(x)
        best.append((time.perf_counter() - t) / len(mods))
    return statistics.median(best) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    methods = ["fp32", "int4", "int4-kernel", "int4-amx", "bf16", "int8", "w8a8", "fbgemm", "int4-fp32act"]
    if not cpu_kernels.int4_amx_available():
        methods.remove("int4-amx")
    # 2-8: where torch's int4 kernel crosses bf16 (INT4_MAX_ROWS) and the AMX kernel (INT4_AMX_MAX_ROWS)
    rows = (1, 2, 3, 4, 8, 16)
    crossing = ("int4-kernel", "int4-amx", "bf16")
    res: dict = {}
    with OutsideLoad() as load:
        for name, (N, K) in SHAPES.items():
            copies = max(2, -(-64 * 2**20 // (N * K * 4)))
            for method in methods:
                mods = layers(method, N, K, copies if method != "int4-fp32act" else 2)
                for M in rows:
                    if (method == "int4-fp32act" and M > 1) or (M in (2, 3, 4, 8) and method not in crossing):
                        continue
                    x = torch.randn(M, K)
                    res.setdefault(name, {}).setdefault(str(M), {})[method] = round(time_us(mods, x, args.reps), 1)
                del mods
    totals = {str(M): {m: round(sum(res[n][str(M)][m] * PER_STEP[n] for n in SHAPES) / 1e3, 2)
                       for m in methods if m in res["o_proj"][str(M)]} for M in rows}
    path = write_json("quant_kernels", {"threads": 1, "us_per_call": res, "ms_per_step": totals,
                                        "outside_load_cores": load.cores})
    print(f"us per call, 1 thread (other processes used {load.cores or 0:.2f} cores meanwhile)")
    print("| layer [out, in] | rows | " + " | ".join(methods) + " |\n|---|---:|" + "---:|" * len(methods))
    for name, per_m in res.items():
        for M, r in per_m.items():
            print(f"| {name} {list(SHAPES[name])} | {M} | " + " | ".join(str(r.get(m, "-")) for m in methods) + " |")
    for M, t in totals.items():
        print(f"| **a step's linears (ms)** | {M} | " + " | ".join(str(t.get(m, "-")) for m in methods) + " |")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
