"""The Triton kernels compile for Hopper (sm_90, the H200's) on this CPU machine: Triton's own
compiler and ptxas build them ahead of time, with the dtypes and constexprs the GPU check runs
(bf16 with tl.dot on bf16 tiles, fp32; GQA 2, 4, 8; head dim 128; pages of 16). A compile error
here would otherwise first show on the one device call. Runs nothing: the interpreter tests
(tests/test_triton_kernels.py) check the numbers."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# In a child process: the interpreter (TRITON_INTERPRET=1, set by conftest on CPU machines)
# replaces @triton.jit functions with interpreted ones, which cannot be compiled.
COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engines import triton_kernels as K

PTR_INT = {"block_tables": "*i32", "kv_lens": "*i32", "qo_indptr": "*i32", "work_seq": "*i32",
           "work_mblk": "*i32", "slot_mapping": "*i64"}

def signature(fn, dt, consts):
    sig = {}
    for p in fn.params:
        n = p.name
        sig[n] = ("constexpr" if p.is_constexpr else PTR_INT.get(n) or ("fp32" if n == "scale" else
                  "i32" if n.startswith("stride") else f"*{dt}"))
    return sig

out = []
for dt, G in json.loads(sys.argv[1]):
    tdt = {"bf16": "bf16", "fp32": "fp32"}[dt]
    common = dict(PAGE=16, G=G, D=128, BLOCK_D=128, BLOCK_N=64, UPCAST=dt == "fp32",
                  PRECISION="ieee" if dt == "fp32" else "tf32")
    for fn, consts in ((K._decode, dict(common, BLOCK_G=16)), (K._extend, dict(common, BLOCK_M=32)),
                       (K._store_kv, dict(N=8 * 128, BLOCK=1024))):
        k = triton.compile(ASTSource(fn=fn, signature=signature(fn, tdt, consts), constexprs=consts),
                           target=GPUTarget("cuda", 90, 32))
        ptx = k.asm["ptx"]
        out.append({"kernel": fn.__name__, "dtype": dt, "G": G, "cubin_bytes": len(k.asm["cubin"]),
                    "mma": ptx.count("mma.sync") + ptx.count("wgmma"),
                    "shared": k.metadata.shared})
print(json.dumps(out))
"""


@pytest.mark.parametrize("variants", [[["bf16", 2], ["bf16", 8], ["fp32", 4]]])
def test_kernels_compile_for_sm90(variants):
    import json
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(variants)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got) == 3 * len(variants)
    for k in got:
        assert k["cubin_bytes"] > 0, k
        if k["kernel"] != "_store_kv":  # bf16 dots on tensor cores; fp32 ("ieee") on FMAs, exact
            assert (k["mma"] > 0) == (k["dtype"] == "bf16"), k
