"""bench/gpu_check.py runs end to end on CPU (--dry-run: tiny models, torch backend, Triton under
its interpreter), so the script a GPU session gets is known to run. Measures and verifies no GPU."""
from __future__ import annotations

import json
import os

import pytest


def test_gpu_check_dry_run(tmp_path):
    import triton  # noqa: F401  (the test extra brings it; missing it fails, not skips)
    if os.environ.get("TRITON_INTERPRET") != "1":  # a CUDA machine: triton compiles, not interprets
        pytest.skip("the dry run's Triton parity needs the interpreter (conftest sets it only without CUDA)")
    from bench.gpu_check import main
    assert main(["--dry-run", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results" / "gpu_check.json").read_text())
    assert res["dry_run"] and set(res["sections"]) == {"parity", "decode", "modes"}
    par = res["sections"]["parity"]
    assert all(v["all_equal"] for v in par["backends"].values())  # triton (interpreter) vs torch
    assert all(v["all_equal"] and v["replays"] > 0 for v in par["graphs"].values())
    assert len(res["sections"]["modes"]["results"]) == 6
    assert "DRY RUN" in (tmp_path / "RESULTS-gpu.md").read_text()
