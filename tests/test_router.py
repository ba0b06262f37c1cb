"""Runtime behaviour on real tiny models and on SimEngine."""
from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from aiorouter import Router, RouterConfig, RouterError
from engines import Engine
from policies import Policy, SmallLargePolicy, StepResult
from policies.rstitch import normalized_entropy

N_REQ = 16
MAX_TOK = 24


def prompts(n=N_REQ, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def single_model_ids(path, ps, max_tokens=MAX_TOK):
    eng = Engine.from_pretrained(path, num_kv_tokens=8192)
    return [o.token_ids for o in eng.generate(ps, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)]


async def run_all(router, ps, **kw):
    kw = {"max_tokens": MAX_TOK, "temperature": 0.0, "ignore_eos": True, **kw}
    return await asyncio.gather(*(router.generate(p, **kw) for p in ps))


def pair(path, **kw):
    return Router({"small": str(path), "large": str(path)}, RouterConfig(entry="small", **kw))


@pytest.fixture(scope="module")
def tiny_ref(tiny_qwen3):
    ps = prompts()
    return ps, single_model_ids(tiny_qwen3, ps)


@pytest.mark.parametrize("mode", ["delayed", "eager", "sync"])
async def test_identical_models_random_policy_equals_single(tiny_qwen3, tiny_ref, mode):
    ps, ref = tiny_ref
    async with pair(tiny_qwen3, policy="random", policy_args={"p": 0.35, "seed": 7}, mode=mode) as r:
        res = await run_all(r, ps)
        assert [x.token_ids for x in res] == ref
        used = {m for x in res for m in x.models}
        assert used == {"small", "large"}
        h = r.metrics.handoffs
        assert h[("small", "large")] > 20 and h[("large", "small")] > 20
        # handoff-resume: prefix matching ran once per (request, model) first visit, never per handoff
        for s in r.subservers:
            assert s.engine.kv_usage().prefix_matches <= N_REQ
        assert sum(h.values()) > 2 * N_REQ
        # both on this CPU: the heavier model's steps run with a layer hook that lends cores to the other's
        assert r.core_share is not None and sum(r.core_share.layer_hook(i) is not None for i in range(2)) == 1


def _median_entropy_tau(path, ps):
    eng = Engine.from_pretrained(path, num_kv_tokens=4096)
    ents = []
    for p in ps[:4]:
        seq = eng.add_request(p, __import__("engines").SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        while not seq.is_finished:
            out = eng.forward()
            ents += normalized_entropy(out.logits).tolist()
            for s, t in zip(out.seqs, out.next_tokens):
                eng.append_token(s, t)
    return float(np.median(ents))


async def test_identical_models_rstitch_equals_single(tiny_qwen3, tiny_ref):
    ps, ref = tiny_ref
    tau = _median_entropy_tau(tiny_qwen3, ps)  # a random model is unsure everywhere: split at its median
    async with pair(tiny_qwen3, policy="rstitch", policy_args={"tau": tau}) as r:
        res = await run_all(r, ps)
        assert [x.token_ids for x in res] == ref
        counts = {m: sum(x.models.count(m) for x in res) for m in ("small", "large")}
        assert counts["small"] > 0 and counts["large"] > 0, counts


async def test_smollm2_identical_pair_equals_single(smollm2):
    eng = Engine.from_pretrained(smollm2, num_kv_tokens=8192)
    tok = eng.tokenizer
    qs = ["What is 2+2?", "Name a color.", "Say hi.", "What is the capital of Italy?"] * 4
    ps = [tok.apply_chat_template([{"role": "user", "content": q + f" ({i})"}], add_generation_prompt=True)
          for i, q in enumerate(qs)]
    ps = [p if isinstance(p, list) else p["input_ids"] for p in ps]
    ref = [o.token_ids for o in eng.generate(ps, max_tokens=16, temperature=0.0, ignore_eos=True)]
    del eng
    for policy, args in (("random", {"p": 0.35, "seed": 1}), ("rstitch", {"tau": 0.03})):
        async with pair(smollm2, policy=policy, policy_args=args, kv_memory_gb=0.5) as r:
            res = await run_all(r, ps, max_tokens=16)
            assert [x.token_ids for x in res] == ref, policy
            assert {m for x in res for m in x.models} == {"small", "large"}, policy


async def test_stream_is_ordered_once_and_text_matches(tiny_qwen3):
    async with pair(tiny_qwen3, policy="random", policy_args={"p": 0.5}) as r:
        evs = [ev async for ev in r.stream([5, 6, 7], max_tokens=30, ignore_eos=True)]
        assert [e.index for e in evs] == list(range(30))
        assert evs[-1].finish_reason == "length" and all(e.finish_reason is None for e in evs[:-1])
        res = await r.generate([5, 6, 7], max_tokens=30, ignore_eos=True)
        assert res.token_ids == [e.token_id for e in evs]
        assert res.text == "".join(e.text for e in evs) == r.tokenizer.decode(res.token_ids, skip_special_tokens=True)


def kv_clean(router):
    """Every page is free or held (unreferenced) by the prefix cache, and no sequence is left."""
    for s in router.subservers:
        kv = s.engine.kv_usage()
        assert kv.pages_used == 0 and kv.pages_free == kv.pages_total, (s.name, kv)
        assert s.engine.num_unfinished == 0 and kv.parked == 0


class FlakyPolicy(SmallLargePolicy):
    """random-like routing that raises inside route for some requests."""
    name = "flaky"

    def defer(self, result: StepResult):
        if any(r.token_ids[0] == 13 and len(r.token_ids) - r.num_prompt_tokens > 3 for r in result.reqs):
            raise RuntimeError("boom")
        return [random.random() < 0.4 for _ in result.reqs]


async def test_no_kv_leaks_after_mixed_endings(tiny_qwen3):
    async with pair(tiny_qwen3, policy=FlakyPolicy(), kv_memory_gb=0.05) as r:
        rng = random.Random(3)
        ps = prompts(200, seed=3)
        marked = set(range(0, 200, 40))
        for i in marked:
            ps[i] = [13] + ps[i]  # route raises for the batch holding one of these once it has 4 tokens out
        max_tokens = [10 if i in marked else rng.randrange(1, 12) for i in range(200)]
        outcomes, errors = {}, []

        async def one(i, p):
            n = 0
            try:
                async for _ in r.stream(p, max_tokens=max_tokens[i], ignore_eos=True):
                    n += 1
                    if i % 7 == 0 and n == 2:
                        outcomes[i] = "aborted"
                        return  # leaving the loop aborts the request everywhere
                outcomes[i] = "ok"
            except RouterError as e:
                outcomes[i] = "failed"
                errors.append(str(e))

        sem = asyncio.Semaphore(24)

        async def limited(i, p):
            async with sem:
                await one(i, p)

        await asyncio.gather(*(limited(i, p) for i, p in enumerate(ps)))
        # route is asked again per request when it raises for a batch: the marked requests fail
        # alone (0 is aborted before its fault), every other one ends as its client chose
        assert {i for i, o in outcomes.items() if o == "failed"} == {40, 80, 120, 160}, outcomes
        assert all("raised in route on model 'small'" in e and "boom" in e for e in errors), errors
        assert sum(o == "aborted" for o in outcomes.values()) >= 10
        assert sum(o == "ok" for o in outcomes.values()) >= 150
        await asyncio.sleep(0.05)  # let every subserver drain its Release messages
        kv_clean(r)
        assert r.num_active == 0
        # and it still serves
        assert (await r.generate([5, 6], max_tokens=3, ignore_eos=True)).token_ids


async def test_cancelling_the_consumer_aborts(tiny_qwen3):
    async with pair(tiny_qwen3, policy="random", policy_args={"p": 0.5}) as r:
        async def consume():
            async for _ in r.stream([5, 6, 7], max_tokens=500, ignore_eos=True):
                pass
        t = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await asyncio.sleep(0.05)
        assert r.num_active == 0
        kv_clean(r)


class BadDestination(Policy):
    name, num_models = "bad-dest", 2

    def route(self, result):
        return [5] * len(result.reqs)


class RaisingPolicy(Policy):
    name, num_models = "raising", 2

    def route(self, result):
        raise ValueError("my router network exploded")


async def test_bad_input_is_refused_and_router_keeps_serving(tiny_qwen3):
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        pair(tiny_qwen3, policy="nope")
    with pytest.raises(ValueError, match="unknown entry model 'medium'"):
        Router({"small": str(tiny_qwen3)}, RouterConfig(entry="medium"))
    with pytest.raises(ValueError, match="unknown mode"):
        pair(tiny_qwen3, mode="fast")
    with pytest.raises(ValueError, match="has no argument 'q'"):
        pair(tiny_qwen3, policy="random", policy_args={"q": 1})
    for policy, msg in ((BadDestination(), "which has 1 peers"), (RaisingPolicy(), "my router network exploded")):
        async with pair(tiny_qwen3, policy=policy) as r:
            with pytest.raises(RouterError, match=msg):
                await r.generate([5, 6, 7], max_tokens=5)
            r.policy = make_single()
            assert len((await r.generate([5, 6, 7], max_tokens=5, ignore_eos=True)).token_ids) == 5
            kv_clean(r)
    async with pair(tiny_qwen3) as r:
        for bad in ([], [5, 10_000], "x" * 0):
            with pytest.raises(ValueError):
                await r.generate(bad, max_tokens=3)
        with pytest.raises(ValueError, match="max_tokens"):
            await r.generate([5], max_tokens=0)
        assert (await r.generate([5, 6], max_tokens=2, ignore_eos=True)).token_ids


def make_single():
    from policies import SinglePolicy
    p = SinglePolicy()
    p.bind(["small", "large"])
    return p


async def test_vocabulary_mismatch_is_refused(tiny_qwen3, tmp_path):
    from conftest import make_tiny_qwen3
    other = make_tiny_qwen3(tmp_path / "v1000", vocab=1000)
    r = Router({"a": str(tiny_qwen3), "b": str(other)})
    with pytest.raises(ValueError, match="share one vocabulary"):
        await r.start()


async def test_the_router_leaves_the_engines_it_was_handed_as_they_were(tiny_qwen3):
    """Core sharing, the fault plan and the reserved rows are the router's, passed per step: an
    engine it was handed keeps its attributes, bound to the same objects, while it serves and after,
    and generates alone afterwards as an engine that never served (no fault plan left on it)."""
    from aiorouter.faults import FaultPlan
    engines = [Engine.from_pretrained(tiny_qwen3, num_kv_tokens=1024) for _ in range(2)]
    marked = [501, 502, 7, 8]
    ref = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=1024).generate([marked], max_tokens=6, temperature=0.0,
                                                                          ignore_eos=True)

    def attrs(e):
        return {k: id(v) for k, v in vars(e).items()}

    before = [attrs(e) for e in engines]
    cfg = RouterConfig(policy="random", policy_args={"p": 0.5, "seed": 1}, mode="eager",
                       faults=FaultPlan({"nan": (501, 502)}))
    async with Router(dict(zip(("small", "large"), engines)), cfg) as r:
        assert r.core_share is not None  # both on this CPU: the heavy model's steps run with a layer hook
        with pytest.raises(RouterError, match="non-finite logits"):
            await r.generate(marked, max_tokens=6, ignore_eos=True)
        assert [attrs(e) for e in engines] == before
    assert [attrs(e) for e in engines] == before
    for e in engines:
        assert e.generate([marked], max_tokens=6, temperature=0.0, ignore_eos=True)[0].token_ids == ref[0].token_ids
