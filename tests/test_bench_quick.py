"""The benchmark harness: the baselines compute what the engine computes, the workloads have
the promised shape, and `bench.run --quick` produces every system, every ratio and the plots."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from bench import workloads as W
from bench.baselines import HFNaive, RandomRule, RStitchRule, StdServing
from engines import Engine


def _prompts(vocab: int, lens=(9, 14, 11)) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


def _engine_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    eng = Engine(path, load_tokenizer=False)
    return [o.token_ids for o in eng.generate(prompts, max_tokens=n, temperature=0.0, ignore_eos=True)]


def test_workloads_shape():
    low, high, ag = (W.make(w) for w in W.WORKLOADS)
    assert low.max_tokens == 256 and high.max_tokens == 1024 and ag.max_tokens == 128
    assert 90 <= low.mean_prompt_len <= 110 and 90 <= high.mean_prompt_len <= 110
    assert abs(ag.mean_prompt_len - 2048) < 64
    assert all(2 <= t < 4096 for p in low.prompts + ag.prompts for t in p)
    sessions, turns = ag.meta["sessions"], ag.meta["turns"]
    for t in range(1, turns):  # each turn extends the same session's previous turn
        for s in range(sessions):
            prev, cur = ag.prompts[(t - 1) * sessions + s], ag.prompts[t * sessions + s]
            assert cur[:len(prev)] == prev and len(cur) > len(prev)
    assert ag.prompts[0][:512] == ag.prompts[1][:512]  # shared preamble across sessions
    assert W.make("low-effort") .prompts == low.prompts  # seeded
    warm = W.warmup_prompt()
    assert all(p[:16] != warm[:16] for p in low.prompts + high.prompts + ag.prompts)


def test_hf_naive_is_lockstep_greedy(tiny_qwen3):
    """Same model on both sides: routing cannot change the tokens, so the padded, lazily
    caught-up lock-step batch must reproduce the engine's greedy output row by row."""
    prompts = _prompts(512)
    hf = HFNaive(tiny_qwen3, tiny_qwen3, RandomRule(0.5, 1), threads=1)
    res = hf.generate(prompts, 8)
    assert res.tokens == _engine_greedy(tiny_qwen3, prompts, 8)
    assert res.small_forwards == 8 and 1 <= res.large_forwards <= 8  # large only when some row needs it
    large = sum(map(sum, res.traces))
    assert 0 < large < 24 and all(len(t) == 8 for t in res.traces)


def test_hf_naive_rstitch_rule(tiny_qwen3):
    prompts = _prompts(512, (10, 12))
    for tau in (0.0, 1.0):  # always unsure: large makes every token; never unsure: small does
        res = HFNaive(tiny_qwen3, tiny_qwen3, RStitchRule(tau), threads=1).generate(prompts, 5)
        assert res.tokens == _engine_greedy(tiny_qwen3, prompts, 5)
        assert all(set(t) == ({1} if tau == 0.0 else {0}) for t in res.traces)


async def test_std_serving_fresh_request_per_token(tiny_qwen3):
    prompts = _prompts(512)
    from policies import RandomPolicy
    async with StdServing({"small": tiny_qwen3, "large": tiny_qwen3}, RandomPolicy(0.35, 2), kv_memory_gb=0.05) as std:
        import asyncio
        outs = [[] for _ in prompts]
        traces = [[] for _ in prompts]

        async def one(i):
            async for m in std.stream(prompts[i], 12, out=outs[i]):
                traces[i].append(m)

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        stats = await std.stats()
    want = _engine_greedy(tiny_qwen3, prompts, 12)
    assert outs == want
    n_large = sum(t.count("large") for t in traces)
    assert 0 < n_large < 36
    # every output position asks the small server once; every handed-off one asks the large too
    assert stats["small"]["requests"] == 36 and stats["large"]["requests"] == n_large
    assert stats["small"]["prefix_matches"] == 36  # each call is a fresh request: prefix-matched
    assert stats["small"]["mean_batch"] > 1.0  # continuous batching across in-flight calls


def test_bench_quick(tmp_path):
    from bench.run import RATIOS, SYSTEMS, main
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "quick.json").read_text())
    cell = data["results"]["cpu-tiny"]["low-effort"]
    for n in ("1", "4", "8", "16"):
        for s in SYSTEMS:
            r = cell[n][s]
            assert not r.get("error"), (n, s, r.get("error"))
            assert r["tok_s"] > 0 and r["tokens"] == r["requests"] * 16
            assert r["ttft_p50"] is not None and r["e2e_p90"] is not None and r["per_user_tok_s"] > 0
            assert abs(sum(r["model_fraction"].values()) - 1) < 1e-9
    assert cell["1"]["large-alone"]["model_fraction"] == {"large": 1.0}
    assert 0.1 < cell["16"]["aiorouter"]["model_fraction"]["large"] < 0.6
    assert [r["name"] for r in data["ratios"]] == [r[0] for r in RATIOS]
    for r in data["ratios"]:
        assert r["value"] is not None and r["value"] > 0 and r["met"] in (True, False) and r["target"] > 0
    assert data["machine"]["cores"] == os.cpu_count() and data["config"]["threads"]
    for p in ("throughput", "tradeoff", "ablation"):
        assert (tmp_path / f"quick-{p}.png").stat().st_size > 1000
    md = (tmp_path / "quick.md").read_text()
    assert "## Targets" in md and "aiorouter / Std. Serving" in md
