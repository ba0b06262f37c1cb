"""rstitch's tau for a real pair (bench/common.py, calibrate): the chain's large-model share, and a calibration
on real engines that lands near its target."""
import os
import shutil

import numpy as np
import pytest

import bench.common
from bench.common import calibrate, large_share


def test_large_share_is_the_two_state_chain():
    h_small = np.array([0.1, 0.2, 0.3, 0.4])  # hands off when H > tau
    h_large = np.array([0.05, 0.25, 0.35, 0.45])  # hands back when H <= tau
    # tau 0.25: p = 2/4 (0.3, 0.4), q = 2/4 (0.05, 0.25) -> 0.5
    assert large_share(0.25, h_small, h_large) == 0.5
    # tau 0.15: p = 3/4, q = 1/4 -> 0.75
    assert large_share(0.15, h_small, h_large) == 0.75
    assert large_share(1.0, h_small, h_large) == 0.0  # nothing handed off


def test_calibration_on_real_engines_hits_the_target(tiny_qwen3):
    prompts = [[5 + i, 17, 230 + i, 41, 9] for i in range(3)]
    cal = calibrate(tiny_qwen3, tiny_qwen3, prompts, target=0.35, steps=12)
    assert cal["tokens"] == 36
    assert 0.0 <= cal["tau"] <= 1.0
    assert abs(cal["large_share"] - 0.35) < 0.1



def test_calibration_is_cached_per_checkpoints_and_arguments(tiny_qwen3, tmp_path, monkeypatch):
    model = shutil.copytree(tiny_qwen3, tmp_path / "model")  # a copy: this test changes it
    cache, prompts = tmp_path / "cache", [[5, 17, 230, 41, 9]]
    first = calibrate(model, model, prompts, target=0.35, steps=6, cache=cache)
    assert len(list(cache.glob("tau-*.json"))) == 1

    def no_decoding(*a, **k):
        raise AssertionError("decoded again")
    monkeypatch.setattr(bench.common, "entropies", no_decoding)
    assert calibrate(model, model, prompts, target=0.35, steps=6, cache=cache) == first
    with pytest.raises(AssertionError, match="decoded again"):  # another target is another entry
        calibrate(model, model, prompts, target=0.5, steps=6, cache=cache)
    st = (model / "config.json").stat()
    os.utime(model / "config.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(AssertionError, match="decoded again"):  # so is a changed checkpoint
        calibrate(model, model, prompts, target=0.35, steps=6, cache=cache)
