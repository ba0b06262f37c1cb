"""bench.cpu_decode: the engine side decodes on a real model and its profile accounts for the whole
of a step; the op groups name the ops they claim; without llama.cpp its row says why."""
import json

import pytest

from bench.cpu_decode import engine_child, group_of, main


def test_op_groups():
    assert group_of("aten::_weight_int4pack_mm_for_cpu") == group_of("mkldnn::_linear_pointwise") == "linear layers"
    assert group_of("aten::_int_mm") == "linear layers"
    assert group_of("aiorouter_cpu::paged_attention") == "attention"
    assert group_of("aiorouter_cpu::add_rms_norm") == "norms"
    assert group_of("aten::argmax") == "sampling"
    assert group_of("aten::index_copy_") == group_of("aten::_to_copy") == "other ops"


def test_engine_side_decodes_and_its_profile_splits_the_whole_step(tiny_qwen3):
    got = engine_child(str(tiny_qwen3), None, list(range(2, 12)), tokens=6, runs=2, profile=True)
    assert len(got["tok_s"]) == 2 and all(x > 0 for x in got["tok_s"])
    prof = got["profile_ms"]
    step = prof.pop("step (profiled)")
    assert step > 0 and prof["linear layers"] > 0 and prof["attention"] > 0
    assert sum(prof.values()) == pytest.approx(step, rel=1e-3)  # the parts and the gaps are the step


@pytest.mark.slow
def test_without_llama_cpp_the_engine_sides_run_and_the_reason_is_kept(tmp_path):
    out = tmp_path / "cpu_decode.json"
    # no such interpreter: llama.cpp's side fails and is reported, the engine's are measured
    nowhere = str(tmp_path / "no-python")
    assert main(["--rounds", "1", "--runs", "1", "--tokens", "4", "--no-profile", "--llama-python", nowhere,
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert f"cannot run {nowhere}" in res["missing"]["llama.cpp"] and res["tok_s"]["llama.cpp"] == []
    assert len(res["tok_s"]["int4"]) == 1 and len(res["tok_s"]["fp32"]) == 1
