"""Std. Serving as the paper built it (bench/baselines.py, in process and over HTTP) and the sweep that
compares it in the paper's regime (bench/paper_regime.py): the per-token protocol over HTTP computes
what aiorouter computes, routes as the in-process dispatcher does, and the sweep writes its schema."""
from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import numpy as np
import torch

from aiorouter import Router, RouterConfig
from bench.baselines import EngineServer, ServerProcesses, ServerSpec, StdServing, TokenDispatcher
from engines import Engine, EngineConfig
from policies import RandomPolicy, RStitchPolicy

N_TOK = 10


def _prompts(n=3, seed=4):
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(rng.randrange(5, 30))] for _ in range(n)]


async def _dispatch(disp: TokenDispatcher, prompts, rids):
    """Every prompt at once; -> (output tokens, model names) per prompt."""
    async def one(p, rid):
        toks, models = [], []
        async for t, m in disp.stream(p, N_TOK, rid=rid):
            toks.append(t)
            models.append(m)
        return toks, models
    res = await asyncio.gather(*(one(p, r) for p, r in zip(prompts, rids)))
    return [r[0] for r in res], [r[1] for r in res]


async def test_http_per_token_protocol_matches_aiorouter(tiny_qwen3):
    """Identical models on both servers: whatever the routing, greedy tokens must be the engine's and
    aiorouter's. The random policy routes by request id alone, so HTTP and in-process dispatchers
    given the same ids route every token alike; rstitch reads logits, which travel bit-exact."""
    ps, rids = _prompts(), ["a", "b", "c"]
    ref = [o.token_ids for o in Engine(tiny_qwen3, config=EngineConfig(num_kv_tokens=4096), load_tokenizer=False)
           .generate(ps, max_tokens=N_TOK, temperature=0.0, ignore_eos=True)]
    async with Router({"small": str(tiny_qwen3), "large": str(tiny_qwen3)}, RouterConfig(policy="random",
                      policy_args={"p": 0.5, "seed": 3}, kv_memory_gb=0.05)) as r:
        routed = [x.token_ids for x in await asyncio.gather(*(
            r.generate(p, max_tokens=N_TOK, temperature=0.0, ignore_eos=True) for p in ps))]
    assert routed == ref

    specs = [ServerSpec(n, str(tiny_qwen3), page_size=1, kv_memory_gb=0.05) for n in ("small", "large")]
    async with ServerProcesses(specs) as sp:
        disp = TokenDispatcher(sp.clients, RandomPolicy(0.5, 3))
        http_toks, http_models = await _dispatch(disp, ps, rids)
        assert http_toks == ref
        assert {m for ms in http_models for m in ms} == {"small", "large"}
        # one fresh request per output position on small, one more per position it handed to large
        n_large = sum(ms.count("large") for ms in http_models)
        assert disp.times.calls == {"small": 3 * N_TOK, "large": n_large}
        stats = await sp.stats()
        assert stats["small"]["requests"] == 3 * N_TOK and stats["large"]["requests"] == n_large
        assert stats["small"]["prefix_matches"] == 3 * N_TOK  # every call is admitted and prefix-matched anew
        assert stats["small"]["handler_s"] > 0 and stats["small"]["forward_s"] > 0

        # the logits and hidden states that travel are the ones the engine computed (batch 1 both sides)
        local = await EngineServer("local", Engine(tiny_qwen3, config=EngineConfig(page_size=1, num_kv_tokens=4096),
                                                   load_tokenizer=False)).start()
        try:
            for p in ps:
                a = await sp.clients[0].next_token(p, logits=True, hidden=True)
                b = await local.next_token(p, logits=True, hidden=True)
                assert a.token == b.token and torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
            assert (await sp.clients[0].next_token(ps[0], logits=False, hidden=False)).logits is None
        finally:
            await local.close()

        # rstitch over HTTP: tau 0 -> every position to large, tau 1 -> none
        for tau, want in ((0.0, {"large"}), (1.0, {"small"})):
            toks, models = await _dispatch(TokenDispatcher(sp.clients, RStitchPolicy(tau)), ps, rids)
            assert toks == ref and {m for ms in models for m in ms} == want

        # a bad body is refused with a reason, and the server keeps serving
        async with aiohttp.ClientSession() as s:
            async with s.post(sp.clients[0].url + "/generate", data=b"\x01\x02\x03") as resp:
                assert resp.status == 400 and "int32" in (await resp.json())["error"]
            async with s.post(sp.clients[0].url + "/generate",
                              data=np.asarray([2, 9999], "<i4").tobytes()) as resp:
                assert resp.status == 400 and "[0, 512)" in (await resp.json())["error"]
        await sp.reset()
        assert (await sp.stats())["small"]["requests"] == 0

    async with StdServing({"small": tiny_qwen3, "large": tiny_qwen3}, RandomPolicy(0.5, 3), kv_memory_gb=0.05) as std:
        in_toks, in_models = await _dispatch(std.dispatcher, ps, rids)
    assert in_toks == ref and in_models == http_models  # same policy, same ids: the same routing


def test_paper_regime_quick_schema(tmp_path):
    """A reduced --quick (sim pair, N = 2, 4 and 16 tokens) runs every system, then --resume adds
    N = 1 for one system and keeps the earlier runs."""
    from bench.paper_regime import SYSTEMS, main
    out, md = tmp_path / "out", tmp_path / "tables.md"
    assert main(["--quick", "--pairs", "sim", "--concurrency", "2", "--tokens", "4", "--out", str(out),
                 "--md", str(md)]) == 0
    first = json.loads((out / "paper_regime.json").read_text())
    assert main(["--quick", "--pairs", "sim", "--concurrency", "1,2", "--tokens", "4", "--out", str(out),
                 "--md", str(md), "--systems", "aiorouter-delayed", "--resume"]) == 0
    data = json.loads((out / "paper_regime.json").read_text())
    runs = data["runs"]
    assert not data["partial"] and len(runs) == 2 * len(SYSTEMS) + 2
    key = lambda r: (r["system"], r["N"], r["max_tokens"])
    assert {key(r): r["wall_s"] for r in first["runs"]}.items() <= {key(r): r["wall_s"] for r in runs}.items()
    for r in runs:
        assert not r.get("error"), r
        assert r["engine"] == "sim" and r["pair"] == "sim" and r["workload"] == "low-effort"
        assert r["system"] in SYSTEMS and r["N"] in (1, 2) and r["max_tokens"] in (4, 16)
        assert r["tokens_per_s"] > 0 and r["per_user_tokens_per_s"] > 0
        assert r["tokens"] == r["requests"] * r["max_tokens"] and r["requests"] >= r["N"]
    for r in runs:  # no schedule beats N requests that never wait (equal at N = 1: nothing to wait for)
        if r["system"] == "aiorouter-delayed":
            assert r["ceiling_tokens_per_s"] == r["N"] * 1000 / (6.0 + 0.35 * 27.9)
            assert r["dtmc_tokens_per_s"] <= r["ceiling_tokens_per_s"] * (1 + 1e-9)
    # 4 requests per client at 4 tokens, 1 at 16: every client writes as many tokens at both lengths
    assert {(r["max_tokens"], r["requests_per_client"]) for r in runs if r["N"] == 2} == {(4, 4), (16, 1)}
    http = next(r for r in runs if r["system"] == "std-serving-http" and r["max_tokens"] == 16)
    small = http["breakdown"]["small"]
    assert small["requests"] == http["servers"]["small"]["requests"] > 0
    assert small["per_step_ms"]["forward"] >= 6.0  # a sim step sleeps the paper's 6.0 ms at least
    assert small["per_token_ms"]["round_trip"] > small["per_token_ms"]["step"] > 0
    assert small["per_token_ms"]["http_outside_server"] > 0
    targets = {t["name"]: t for t in data["targets"]}
    missing = targets["sim low-effort@4: delayed / Std HTTP, N=4"]  # no N = 4 here: listed, not measured
    assert missing["value"] is None and missing["met"] is None
    change = targets["sim low-effort@4 -> low-effort@16: delayed throughput change, N=2 (%)"]
    assert change["value"] >= 0 and change["met"] in (True, False)
    assert data["length_scaling"] and data["paper_side_by_side"][0]["pair"] == "sim"
    text = md.read_text()
    assert text.startswith("# The paper's regime") and "| figure | paper" in text and "Table 10" in text

