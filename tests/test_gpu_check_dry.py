"""bench/gpu_check.py runs end to end on CPU (--dry-run: tiny models, torch backend, Triton under
its interpreter), so the script a GPU session gets is known to run. Measures and verifies no GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run(tmp_path):
    import triton  # noqa: F401  (the test extra brings it; missing it fails, not skips)
    # A child process with CUDA hidden and the interpreter on: Triton reads TRITON_INTERPRET when it
    # is first imported, so on a CUDA machine this process's Triton compiles and cannot interpret.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "results" / "gpu_check.json").read_text())
    assert res["dry_run"] and set(res["sections"]) == {"parity", "decode", "modes"}
    par = res["sections"]["parity"]
    assert all(v["all_equal"] for v in par["backends"].values())  # triton (interpreter) vs torch
    assert all(v["all_equal"] and v["replays"] > 0 for v in par["graphs"].values())
    assert len(res["sections"]["modes"]["results"]) == 6
    assert "DRY RUN" in (tmp_path / "RESULTS-gpu.md").read_text()
