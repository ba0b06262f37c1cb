"""torch's weight-only int4 / int8 CPU kernels (engines/quant.py) against the oneDNN-packed fp32
Linear (engines/model.Linear), on SmolLM2-135M's layer shapes, at 1 and 16 rows, 1 thread.

Each layer is built in enough copies to pass 64 MB of fp32 weights and the calls cycle through
them, so no weight is in cache when it is read, as in a decode step of the whole model. Total =
30 layers of each decoder shape plus the head, per step. Methods: fp32 (oneDNN, packed);
int4 (`_weight_int4pack_mm_for_cpu`, bf16 activations, groups of 32); int8 (`_weight_int8pack_mm`,
bf16 activations); w8a8 (`torch._int_mm`, int8 activations per token); and int4 on fp32
activations, the kernel's scalar path, at 1 row only.

    python bench/quant_kernels.py [--reps 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import OutsideLoad, write_json
from engines.model import Linear
from engines.quant import QuantLinear

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}  # [out, in]
PER_STEP = {"qkv_proj": 30, "o_proj": 30, "gate_up_proj": 30, "down_proj": 30, "lm_head": 1}


class _Fp32Int4(torch.nn.Module):
    """The int4 kernel called with fp32 activations and scales (what a float32 model would hand it)."""

    def __init__(self, q: QuantLinear):
        super().__init__()
        self.q, self.sz = q, q.scales.float()

    def forward(self, x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.q.qweight, self.q.group_size, self.sz)


def layers(method: str, N: int, K: int, copies: int) -> list[torch.nn.Module]:
    out = []
    for i in range(copies):
        w = torch.randn(N, K, generator=torch.Generator().manual_seed(i)) * 0.05
        if method == "fp32":
            lin = Linear(K, N, bias=False)
            lin.weight.data.copy_(w)
            lin.pack()
            out.append(lin)
        else:
            q = QuantLinear(w, None, "int4" if method == "int4-fp32act" else method)
            out.append(_Fp32Int4(q) if method == "int4-fp32act" else q)
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
    methods = ["fp32", "int4", "int8", "w8a8", "int4-fp32act"]
    res: dict = {}
    with OutsideLoad() as load:
        for name, (N, K) in SHAPES.items():
            copies = max(2, -(-64 * 2**20 // (N * K * 4)))
            for method in methods:
                mods = layers(method, N, K, copies if method != "int4-fp32act" else 2)
                for M in (1, 16):
                    if method == "int4-fp32act" and M > 1:
                        continue
                    x = torch.randn(M, K)
                    res.setdefault(name, {}).setdefault(str(M), {})[method] = round(time_us(mods, x, args.reps), 1)
                del mods
    totals = {str(M): {m: round(sum(res[n][str(M)][m] * PER_STEP[n] for n in SHAPES) / 1e3, 2)
                       for m in methods if m in res["o_proj"][str(M)]} for M in (1, 16)}
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
