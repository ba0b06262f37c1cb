"""Offline API behaviour: sampling options, stops, bad input, chunked prefill, SimEngine."""
from __future__ import annotations

import json

import pytest
import torch

from engines import Engine, EngineConfig, SamplingParams
from engines.sim import SimEngine


@pytest.fixture(scope="module")
def eng(tiny_qwen3):
    return Engine.from_pretrained(tiny_qwen3, num_kv_tokens=2048, max_model_len=256)


@pytest.mark.parametrize("bad, msg", [
    (dict(prompt=[]), "empty"),
    (dict(prompt=""), "empty"),
    (dict(prompt=[5] * 300), "context"),
    (dict(prompt=[5, 600]), "vocabulary"),
    (dict(prompt=[5, -1]), "vocabulary"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
])
def test_bad_input_is_refused_and_engine_keeps_serving(eng, bad, msg):
    kw = dict(prompt=[5, 6, 7], max_tokens=4, temperature=0.0)
    kw.update(bad)
    prompt = kw.pop("prompt")
    with pytest.raises(ValueError, match=msg):
        eng.generate([[9, 9], prompt], **kw)
    assert not eng.has_unfinished()  # all-or-nothing: the good prompt was not left behind
    assert eng.generate([5, 6, 7], max_tokens=3, temperature=0.0, ignore_eos=True)[0].token_ids


def test_bad_model_dirs(tmp_path, tiny_qwen3):
    with pytest.raises(FileNotFoundError, match="config.json"):
        Engine.from_pretrained(tmp_path)
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_qwen3 / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ValueError, match="corrupt safetensors file .*model.safetensors"):
        Engine.from_pretrained(bad)
    cfg = json.loads((tiny_qwen3 / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model_type"):
        Engine.from_pretrained(bad)


def test_seeded_sampling_is_reproducible_and_batch_independent(eng):
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    alone = eng.generate([[5, 6, 7]], p)[0].token_ids
    in_batch = eng.generate([[1, 2, 3, 4], [5, 6, 7], [9] * 20], p)[1].token_ids
    assert alone == in_batch
    other = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0.9, seed=124, ignore_eos=True))
    assert other[0].token_ids != alone


def test_filters_that_leave_one_token_equal_greedy(eng):
    greedy = eng.generate([[5, 6, 7]], max_tokens=8, temperature=0.0, ignore_eos=True)[0].token_ids
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        got = eng.generate([[5, 6, 7]], max_tokens=8, temperature=1.3, seed=1, ignore_eos=True, **kw)[0].token_ids
        assert got == greedy, kw


def test_min_p_and_top_k_restrict_support():
    from engines.sampling import sample
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0, -3.0]]).repeat(200, 1)
    ps = [SamplingParams(temperature=1.0, top_k=2)] * 200
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    toks = set(sample(logits, ps, gens).tolist())
    assert toks == {0, 1}
    ps = [SamplingParams(temperature=1.0, min_p=0.5)] * 200
    assert set(sample(logits, ps, gens).tolist()) == {0, 1}


def test_stop_strings_and_token_ids(eng):
    base = eng.generate([[5, 6, 7]], max_tokens=20, temperature=0.0, ignore_eos=True)[0]
    stop_tok = base.token_ids[4]
    out = eng.generate([[5, 6, 7]], max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_tok,))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:base.token_ids.index(stop_tok) + 1]


def test_chunked_prefill_matches_unchunked(tiny_qwen3, eng):
    prompt = list(range(2, 200))
    small_budget = Engine(tiny_qwen3, config=EngineConfig(num_kv_tokens=2048, max_num_batched_tokens=32))
    a = small_budget.generate([prompt, [3, 4]], max_tokens=10, temperature=0.0, ignore_eos=True)
    b = eng.generate([prompt, [3, 4]], max_tokens=10, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert small_budget.stats.num_steps > eng.stats.num_steps * 0 + 10 + 198 // 32 - 1


def test_max_model_len_truncates(tiny_qwen3):
    e = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=1024, max_model_len=40)
    out = e.generate([list(range(2, 32))], max_tokens=100, temperature=0.0, ignore_eos=True)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10


def test_sim_engine_step_semantics():
    e = SimEngine(latency_a=0.0, latency_c=0.0, config=EngineConfig(num_kv_tokens=512))
    outs = e.generate(["hello", "a much longer prompt here"], max_tokens=30, temperature=0.0)
    assert all(len(o.token_ids) == 30 and o.finish_reason == "length" for o in outs)
    again = SimEngine(latency_a=0.0).generate(["hello"], max_tokens=30, temperature=0.0)[0]
    assert again.token_ids == outs[0].token_ids  # deterministic, batch-independent
    assert e.kv_usage().pages_free == e.kv_usage().pages_total
    with pytest.raises(ValueError, match="latenc"):
        SimEngine(latency_a=-1.0)


def test_sim_engine_sleeps_its_latency():
    import time
    e = SimEngine(latency_a=0.004, latency_c=0.002)
    t0 = time.perf_counter()
    e.generate(["x"] * 4, max_tokens=10, temperature=0.0)  # 1 prefill step + 9 decode steps at b = 4
    dt = time.perf_counter() - t0
    assert dt >= 10 * (0.004 + 0.002 * 4)
    assert e.stats.num_steps == 10


def test_never_written_kv_cannot_poison_padded_decodes(tiny_qwen3):
    """Decodes of different lengths are padded; padding must not read never-written KV slots
    (a reused heap block can hold NaN, and 0 * NaN is NaN)."""
    ref = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=1024)
    prompts = [[5, 6, 7], list(range(2, 40)), [9] * 17]
    want = [o.token_ids for o in ref.generate(prompts, max_tokens=12, temperature=0.0, ignore_eos=True)]
    poisoned = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=1024)
    kv = poisoned.runner.kv
    kv.k[:, :kv.num_slots].fill_(float("nan"))
    kv.v[:, :kv.num_slots].fill_(float("nan"))
    got = [o.token_ids for o in poisoned.generate(prompts, max_tokens=12, temperature=0.0, ignore_eos=True)]
    assert got == want
