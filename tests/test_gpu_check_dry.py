"""bench/gpu/check.py runs end to end on CPU (--dry-run: tiny models, Triton under its interpreter),
each section in its own process, and falls back to the torch backend with CUDA graphs off when
Triton fails, so the one call a GPU session gets is known to run and to come back with figures.
Measures and verifies no GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _check(tmp_path: Path, *args: str) -> dict:
    import triton  # noqa: F401  (the test extra brings it; missing it fails, not skips)
    out = tmp_path / "out"
    # OUT as the device machine sets it; CUDA hidden (a CUDA machine would otherwise compile Triton)
    env = {**os.environ, "OUT": str(out), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "check.py"), "--dry-run", *args],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert {p.name for p in out.iterdir()} == {"gpu_check.json", "gpu_check.md", "gpu_check.log"}
    return json.loads((out / "gpu_check.json").read_text())


def test_dry_run_writes_to_out_and_falls_back_when_triton_fails(tmp_path):
    """Triton fails in parity (the injected hook): parity reruns on the torch backend, and every
    later section runs there with graphs off and still brings its figures."""
    res = _check(tmp_path, "--simulate-triton-failure", "parity")
    sec = res["sections"]
    assert res["dry_run"] and list(sec) == ["triton", "parity", "overlap", "modes", "decode", "host"]
    assert all(s["status"] == "ok" for s in sec.values()), {k: s.get("error") for k, s in sec.items()}
    assert sec["triton"]["ok"] and sec["triton"]["attention"] == "default"
    first = sec["parity"]["triton_attempt"]
    assert first["status"] == "error" and "simulated Triton failure in section parity" in first["error"]
    assert "parity" in res["fallback"]
    assert sec["parity"]["ok"] and list(sec["parity"]["candidates"]) == ["torch/bfloat16"]
    for name in ("parity", "overlap", "modes", "decode", "host"):
        assert sec[name]["attention"] == "torch" and sec[name]["graphs"] is False, name
    rungs = sec["modes"]["rungs"]
    assert "CUDA graphs are off" in rungs["+graphs"]["skipped"]
    for rung in ("base", "+async", "+delayed"):
        assert rungs[rung]["N=2"]["tok_s"] > 0 and rungs[rung]["N=2"]["tokens"] == 2 * 8, rung
    assert sec["overlap"]["steps"]["together_wall_s"] > 0
    assert all(r["results"]["batch=2"]["tok_s"] > 0 for m in sec["decode"]["models"].values()
               for r in (m["graphs=False"],))
    one = sec["host"]["router_eager"]["N=1"]
    assert one["ms_per_token"] > 0 and one["steps"]["small"] > 0
    assert one["overhead_ms_per_token"] == one["ms_per_token"] - one["engine_ms_per_token"]
    ceiling = sec["host"]["ceiling"]["N=2"]  # the runtime alone on zero-latency sims, with its parts
    assert ceiling["us_per_token"] > 0 and abs(sum(ceiling["parts_us_per_token"].values()) - ceiling["us_per_token"]) \
        < 1e-6 * ceiling["us_per_token"] and ceiling["parts_us_per_token"]["routing"] > 0
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "DRY RUN" in md and "Fallback: section parity failed with Triton" in md and "ceiling (zero-latency sims)" in md


def test_triton_candidates_then_a_real_triton_compile_error(tmp_path):
    """parity with its Triton candidates (the interpreter); then the probe, given a block size Triton
    refuses, fails with Triton's own error, and the section after it runs without Triton."""
    res = _check(tmp_path, "--sections", "parity,triton,host", "--simulate-triton-failure", "probe")
    sec = res["sections"]
    cands = sec["parity"]["candidates"]
    assert sec["parity"]["ok"] and {"triton/bfloat16", "triton/float32"} <= set(cands)
    assert cands["triton/float32"]["greedy"]["sequences_equal"] == cands["triton/float32"]["greedy"]["sequences"]
    assert cands["triton/float32"]["decode_rel_err_max"] < 1e-4
    assert sec["triton"]["status"] == "error" and "power of 2" in sec["triton"]["error"]
    assert res["fallback"].startswith("the triton section failed")
    assert sec["host"]["status"] == "ok" and sec["host"]["attention"] == "torch"
