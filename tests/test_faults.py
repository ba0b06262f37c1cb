"""Failures on purpose (aiorouter/faults.py): a broken step, NaN/inf logits, a raising policy. Each
fails the requests it touches, with an error naming the model and the cause; the rest of the batch
commits exactly what it would have, and nothing leaks. Real tiny engines throughout."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch
from test_router import kv_clean
from test_server import running_server

from aiorouter import Router, RouterConfig, RouterError
from aiorouter.faults import FaultPlan
from engines import Engine, SamplingParams
from engines.sampling import sample, sample_batched
from server.cli import main as cli_main

MARK = {"step": (501, 502, 503), "nan": (501, 502, 504), "inf": (501, 502, 505),
        "route": (501, 502, 506), "send": (501, 502, 507), "receive": (501, 502, 508)}
PLAN = FaultPlan(MARK, after=2)
N = 6  # requests per batch in the router tests


# -- the sampler --------------------------------------------------------------------------------
@pytest.mark.parametrize("sampler", [sample, sample_batched])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "mixed"])
def test_a_nonfinite_row_samples_in_the_vocabulary_and_leaves_the_others_alone(sampler, bad):
    V = 300
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(4))
    broken = logits.clone()
    broken[1] = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}.get(bad, 0.0)
    if bad == "mixed":
        broken[1, 10], broken[1, 20] = float("nan"), float("inf")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.9),
              SamplingParams(temperature=0.8, seed=11), SamplingParams(top_k=5, seed=12)]

    def gens():
        return [None, None, torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)]

    for _ in range(20):  # the unseeded row draws from the global generator: any draw must be in range
        out = sampler(broken, params, gens())
        assert out.dtype == torch.int64 and 0 <= int(out.min()) and int(out.max()) < V
    clean = sampler(logits, params, gens())
    again = sampler(broken, params, gens())
    assert again[0] == clean[0] == logits[0].argmax()  # greedy: exact
    assert again[2:].tolist() == clean[2:].tolist()  # seeded: the same draws as without the broken row


# -- the engine alone ---------------------------------------------------------------------------
class FaultyEngine(Engine):
    """An engine whose forward meets PLAN's step faults: wrapped when it is built, as a router
    wraps its step functions, so the engine itself carries no fault check."""

    def execute(self, batch, want_hidden=False, reserved_rows=None, layer_hook=None):
        return PLAN.wrap_step(super().execute)(batch, want_hidden, reserved_rows, layer_hook)


def test_engine_step_fails_the_nan_sequence_alone(tiny_qwen3):
    ps = [[7, 8, 9, 10], list(MARK["nan"]) + [7, 8, 9], [11, 12, 13, 14], list(MARK["inf"]) + [9, 9]]
    ref = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=2048).generate(ps, max_tokens=8, temperature=0.0,
                                                                          ignore_eos=True)
    eng = FaultyEngine.from_pretrained(tiny_qwen3, num_kv_tokens=2048)
    got = eng.generate(ps, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert [o.finish_reason for o in got] == ["length", "error", "length", "error"]
    assert got[1].token_ids == ref[1].token_ids[:PLAN.after]  # the tokens before the fault stand
    assert got[0].token_ids == ref[0].token_ids and got[2].token_ids == ref[2].token_ids
    assert eng.kv_usage().pages_used == 0 and not eng.has_unfinished()


def test_a_nan_sequence_shares_none_of_its_kv(tiny_qwen3):
    """Its K/V may be broken too: the pages it computed leave the prefix cache (a clean sequence's stay)."""
    eng = FaultyEngine.from_pretrained(tiny_qwen3, num_kv_tokens=2048)
    body = list(range(100, 140))  # with the marker: 43 tokens, two full pages
    assert eng.generate([list(MARK["nan"]) + body], max_tokens=4, ignore_eos=True)[0].finish_reason == "error"
    kv = eng.kv_usage()
    assert kv.pages_cached == 0 and kv.pages_free == kv.pages_total
    assert eng.generate([[200, 201, 202] + body], max_tokens=4, ignore_eos=True)[0].finish_reason == "length"
    assert eng.kv_usage().pages_cached == 2


# -- through the router -------------------------------------------------------------------------
def batch_of_prompts(kind: str | None) -> list[list[int]]:
    """N prompts of one length (so they step together); the third carries `kind`'s marker."""
    ps = [[20 + i, 30 + i, 40 + i, 50 + i, 60 + i, 70 + i] for i in range(N)]
    if kind is not None:
        ps[2] = list(MARK[kind]) + [33, 44, 55]
    return ps


async def outcomes(router, ps, max_tokens=10):
    async def one(p):
        try:
            return (await router.generate(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)).token_ids
        except RouterError as e:
            return e
    return await asyncio.gather(*(one(p) for p in ps))


@pytest.fixture(scope="module")
def reference(tiny_qwen3):
    eng = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=2048)
    return {kind: [o.token_ids for o in eng.generate(batch_of_prompts(kind), max_tokens=10, temperature=0.0,
                                                      ignore_eos=True)] for kind in (None, *MARK)}


@pytest.mark.parametrize("kind, policy, message", [
    ("nan", "single", "model 'small' produced non-finite logits (NaN or inf) for this request at output token 2"),
    ("inf", "single", "model 'small' produced non-finite logits"),
    ("step", "single", "model 'small' failed a step: InjectedFault('injected step fault"),
    ("nan", "random", "produced non-finite logits"),
    ("step", "random", "failed a step: InjectedFault"),
    ("route", "random", "policy 'random' raised in route on model "),
    ("send", "random", "policy 'random' raised in send on model "),
    ("receive", "random", "policy 'random' raised in receive on model "),
])
async def test_one_fault_fails_one_request_and_the_batch_commits(tiny_qwen3, reference, kind, policy, message):
    """Identical models and greedy decoding: every request that is not marked must produce exactly
    what one model alone produces, though it shared its batches with the broken one."""
    args = {"p": 0.9, "seed": 1} if policy == "random" else None  # route, send, receive: hand off nearly always
    async with Router({"small": str(tiny_qwen3), "large": str(tiny_qwen3)}, RouterConfig(policy=policy, policy_args=args,
                      mode="eager", faults=PLAN, kv_memory_gb=0.05)) as r:
        got = await outcomes(r, batch_of_prompts(kind))
        assert isinstance(got[2], RouterError) and message in str(got[2]), got[2]
        assert [g for i, g in enumerate(got) if i != 2] == [x for i, x in enumerate(reference[kind]) if i != 2]
        if policy == "single":  # no handoffs: the marked request was in every batch of the small model
            assert max(r.metrics.models["small"].batch_sizes) == N
        await asyncio.sleep(0.05)
        kv_clean(r)
        assert r.num_active == 0 and r.num_tasks == 2 and not r.dead_tasks()
        assert (await r.generate([5, 6, 7], max_tokens=4, ignore_eos=True)).token_ids  # and it serves on


async def test_per_request_policies_meet_the_plan_and_what_the_router_was_handed_is_unchanged(tiny_qwen3):
    from policies import RandomPolicy, SinglePolicy
    from policies.base import ReqView
    eng = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=1024)
    given = SinglePolicy()
    async with Router({"small": eng, "large": str(tiny_qwen3)}, RouterConfig(policy=given, faults=PLAN)) as r:
        override = RandomPolicy(p=1.0)
        with pytest.raises(RouterError, match="raised in send on model 'small'"):
            await r.generate(batch_of_prompts("send")[2], max_tokens=6, policy=override)
        assert r.policy is not given and r.policy.name == given.name  # called through the plan
    # the engine and the policy objects were wrapped, never changed: no fault fires through them
    assert eng.generate([list(MARK["nan"]) + [5]], max_tokens=4, ignore_eos=True)[0].finish_reason == "length"
    marked = ReqView("x", 0, list(MARK["send"]) + [1, 2, 3], len(MARK["send"]), 4, (0, 0), (), {}, 1)
    assert PLAN.kind_of(marked.token_ids, marked.num_prompt_tokens) == "send"
    assert override.send(marked).tokens == marked.token_ids  # the policy itself sends


def test_fault_plan_is_checked(tmp_path):
    with pytest.raises(ValueError, match="unknown fault kind 'oops'"):
        FaultPlan({"oops": (1,)})
    with pytest.raises(ValueError, match="the marker of 'nan' starts the marker of 'step'"):
        FaultPlan({"step": (1, 2, 3), "nan": (1, 2)})
    with pytest.raises(ValueError, match="non-empty list of token ids"):
        FaultPlan({"nan": ()})
    path = tmp_path / "plan.json"
    path.write_text(PLAN.to_json())
    assert FaultPlan.load(path) == PLAN
    path.write_text(json.dumps({"markers": {"nan": [1]}, "later": 3}))
    with pytest.raises(ValueError, match="must be an object with 'markers'"):
        FaultPlan.load(path)
    assert PLAN.kind_of(list(MARK["nan"]) + [1, 2, 3], 6) is None  # no output yet
    assert PLAN.kind_of(list(MARK["nan"]) + [1, 2, 3], 5) is None  # one token out
    assert PLAN.kind_of(list(MARK["nan"]) + [1, 2, 3], 4) == "nan"  # two tokens out: it fires
    assert cli_main(["serve", "--model", "a=sim:1", "--inject-faults", str(tmp_path / "none.json")]) == 2


# -- over HTTP ----------------------------------------------------------------------------------
async def test_http_errors_name_the_model_and_the_cache_flush_frees_pages(tiny_chat_model):
    pair = {"small": str(tiny_chat_model), "large": str(tiny_chat_model)}
    async with running_server(pair, policy="single", faults=PLAN) as (url, server, router):
        async with aiohttp.ClientSession() as s:
            body = {"prompt": list(MARK["step"]) + [300, 301], "max_tokens": 8, "ignore_eos": True}
            async with s.post(url + "/v1/completions", json=body) as resp:
                err = (await resp.json())["error"]
                assert resp.status == 500 and err["type"] == "server_error"
                assert "model 'small' failed a step: InjectedFault" in err["message"]
            async with s.post(url + "/v1/completions", json={**body, "prompt": list(MARK["nan"]) + [9], "stream": True}) as resp:
                events = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
                          if line.startswith("data: {")]
                assert resp.status == 200 and len(events) <= 3  # at most two token chunks, then the error
                assert all("error" not in e for e in events[:-1])
                assert "model 'small' produced non-finite logits" in events[-1]["error"]["message"]
            long = {"prompt": "cache me " * 40, "max_tokens": 3, "ignore_eos": True}
            async with s.post(url + "/v1/completions", json=long) as resp:
                assert resp.status == 200
            metrics = await (await s.get(url + "/metrics")).text()
            cached = gauge(metrics, 'aiorouter_kv_pages_cached{model="small"}')
            assert cached >= 4 and gauge(metrics, 'aiorouter_kv_pages_used{model="small"}') == 0
            assert gauge(metrics, 'aiorouter_subserver_tasks{state="running"}') == 2
            assert gauge(metrics, "aiorouter_event_loop_tasks") >= 3
            async with s.post(url + "/reset_prefix_cache") as resp:
                assert (await resp.json())["pages_freed"]["small"] == cached
            metrics = await (await s.get(url + "/metrics")).text()
            assert gauge(metrics, 'aiorouter_kv_pages_cached{model="small"}') == 0
        kv = router.kv_usage()["small"]
        assert kv.pages_free == kv.pages_total and kv.pages_cached == 0


def gauge(text: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


# -- KV pool exhaustion -------------------------------------------------------------------------
async def test_long_prompts_that_exhaust_the_kv_pools_all_complete_exactly(tiny_qwen3):
    """Eight prompts of ~150 tokens on pools of 512 tokens each (room for three at once): the
    schedulers wait and preempt (parked requests' KV included), every request still produces what
    one model alone with room to spare produces, and the pools end empty. A prompt longer than a
    pool is refused up front, naming its length and the context."""
    ps = [[(37 * i + 11 * j) % 490 + 5 for j in range(140 + 3 * i)] for i in range(8)]
    ref = [o.token_ids for o in Engine.from_pretrained(tiny_qwen3, num_kv_tokens=4096).generate(
        ps, max_tokens=12, temperature=0.0, ignore_eos=True)]
    engines = {n: Engine.from_pretrained(tiny_qwen3, num_kv_tokens=512) for n in ("small", "large")}
    async with Router(engines, RouterConfig(policy="random", policy_args={"p": 0.5, "seed": 3}, mode="eager",
                      faults=PLAN)) as r:
        assert await outcomes(r, ps, max_tokens=12) == ref
        preempted = {n: e.kv_usage().preemptions for n, e in engines.items()}
        assert sum(preempted.values()) > 0, preempted
        with pytest.raises(ValueError, match="prompt has 600 tokens; this model's context is 512"):
            r.submit([5] * 600, max_tokens=4)
        await asyncio.sleep(0.05)
        kv_clean(r)
        assert r.num_active == 0 and r.num_tasks == 2 and not r.dead_tasks()
