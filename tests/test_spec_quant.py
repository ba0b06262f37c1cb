"""Quantization per model through the public API: `ModelSpec.quantization` and `--model NAME=PATH:int4`."""
from __future__ import annotations

import pytest
import torch
from test_quant import _engine, _logits

from aiorouter import ModelSpec
from server import cli


def test_model_spec_refuses_an_unknown_quantization_naming_it_and_the_choices(tiny_qwen3):
    with pytest.raises(ValueError, match=r"quantization must be one of int4, int8 or None, got 'int3'"):
        ModelSpec(path=str(tiny_qwen3), quantization="int3")
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelSpec.coerce({"path": str(tiny_qwen3), "quantization": "fp8"})
    with pytest.raises(ValueError, match="sim model has no weights"):
        ModelSpec(engine="sim", quantization="int4")


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_model_spec_quantization_reaches_the_engine(tiny_qwen3, scheme):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (4, 11)]
    spec = ModelSpec.coerce({"path": str(tiny_qwen3), "quantization": scheme})
    built = _logits(spec.build("cpu", kv_memory_gb=0.05, num_models=1), prompts)
    # the same logits as an engine asked for the scheme directly, and not the dense model's
    assert torch.equal(built, _logits(_engine(tiny_qwen3, scheme), prompts))
    assert not torch.equal(built, _logits(ModelSpec(path=str(tiny_qwen3)).build("cpu", 0.05, 1), prompts))


def test_cli_model_takes_a_quantization_suffix(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "odd:int4").mkdir()  # a directory whose own name ends like a suffix stays a path
    got = cli.parse_models([f"small={tmp_path / 'm'}:int4", f"large={tmp_path / 'm'}", f"x={tmp_path / 'odd:int4'}"])
    assert (got["small"].path, got["small"].quantization) == (str(tmp_path / "m"), "int4")
    assert (got["large"].path, got["large"].quantization) == (str(tmp_path / "m"), None)
    assert (got["x"].path, got["x"].quantization) == (str(tmp_path / "odd:int4"), None)


def test_cli_model_names_an_unknown_suffix_and_a_missing_directory(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(cli.CliError, match=r"unknown quantization 'int3' in .*use PATH:int4 or PATH:int8"):
        cli.parse_models([f"small={tmp_path / 'm'}:int3"])
    with pytest.raises(cli.CliError, match=r"'/nonexistent' is not a directory"):
        cli.parse_models(["small=/nonexistent:int4"])
