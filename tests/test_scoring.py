"""Prompt scoring (issue 40, items 2 and 9): `Router.score` and completions' `echo` with
`logprobs`. Teacher-forced log probabilities from one prefill per model, equal to transformers'
log_softmax (single model, and identical models under every policy), a routed score equal to a
slow reference that steps token by token through the same policy, and the KV pages scoring takes
given back."""
from __future__ import annotations

import asyncio

import pytest
import torch
import transformers

from aiorouter import Router, RouterConfig, RouterError
from conftest import make_tiny_qwen3
from engines import Engine
from engines.logprobs import MAX_LOGPROBS
from policies import STAY, ModelInfo, PeerReq, Policy, ReqView, StepResult, make_policy
from policies.rstitch import normalized_entropy
from test_logprobs import TOL, hf_model, policy_cases  # noqa: F401 (hf_model: the fixture, used by name)
from test_policies import ref  # noqa: F401 (the fixture, used by name)

TOP = 3


def texts(ref, n: int = 6) -> list[list[int]]:
    """Texts the tiny model writes naturally: a prompt and its greedy output, as one text."""
    ps, ids, _, _ = ref
    return [p + o for p, o in zip(ps[:n], ids[:n])]


def hf_forward(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' raw logits at every position of `ids`, and its final-normed hidden states."""
    got = []
    hook = model.model.norm.register_forward_hook(lambda _m, _i, out: got.append(out))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
    finally:
        hook.remove()
    return logits, got[0][0].float()


def hf_rows(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' teacher-forced log_softmax at every position, and its final-normed hidden states."""
    logits, hidden = hf_forward(model, ids)
    return torch.log_softmax(logits, dim=-1), hidden


def check_scores(res, ref_lp: torch.Tensor, ids: list[int], k: int) -> None:
    """A ScoreResult against transformers' rows: position p from row p - 1; the first has none."""
    assert res.token_ids == ids and res.logprobs[0] is None and res.models[0] is None
    assert len(res.logprobs) == len(ids)
    for p in range(1, len(ids)):
        row, lp = ref_lp[p - 1], res.logprobs[p]
        assert abs(lp.logprob - float(row[ids[p]])) < TOL, (p, lp.logprob, float(row[ids[p]]))
        vals, top = torch.topk(row, k)
        assert [i for i, _ in lp.top] == top.tolist()
        assert all(abs(a - b) < TOL for (_, a), b in zip(lp.top, vals.tolist()))


def check_same(a, b) -> None:
    """Two ScoreResults of one text: the same values, whichever model scored each position."""
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs[1:], b.logprobs[1:]):
        assert abs(x.logprob - y.logprob) < 1e-5 and [i for i, _ in x.top] == [i for i, _ in y.top]


async def test_engine_and_single_router_equal_transformers_and_give_the_pages_back(tiny_qwen3, hf_model, ref):
    ts = texts(ref)
    # a chunk of 8 tokens: the texts (up to 63 tokens) prefill in several chunks
    eng = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=4096, max_num_batched_tokens=8)
    before = eng.kv_usage()
    scored = eng.score(ts[0], k=TOP)
    assert eng.kv_usage() == before
    ref_lp = hf_rows(hf_model, ts[0])[0]
    assert torch.allclose(scored.token, ref_lp[:-1].gather(1, torch.tensor(ts[0][1:])[:, None]).squeeze(1), atol=TOL)
    async with Router({"m": eng}, RouterConfig(policy="single")) as r:
        await r.generate(ts[1][:5], max_tokens=4, ignore_eos=True)  # the prefix cache holds something now
        before = r.kv_usage()
        # several at once, and a generation beside them: each takes its own pages and gives them back
        res, gen = await asyncio.gather(asyncio.gather(*(r.score(t, top_logprobs=TOP) for t in ts)),
                                        r.generate(ts[2][:7], max_tokens=6, ignore_eos=True))
        wide = await r.score(ts[0], top_logprobs=MAX_LOGPROBS)
        after = r.kv_usage()
        assert after["m"].pages_used == before["m"].pages_used == 0
        # scoring offers no page to the prefix cache (each text fills up to 3 pages of 16; the
        # generation beside them, 12 tokens, none)
        assert after["m"].pages_cached == before["m"].pages_cached
        one = await r.score(ts[0][:1])
        assert one.logprobs == [None] and one.models == [None]
        for bad, field in (({"top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"), ({"top_logprobs": -1}, "top_logprobs")):
            with pytest.raises(ValueError, match=field):
                await r.score(ts[0], **bad)
        with pytest.raises(ValueError, match="prompt is empty"):
            await r.score([])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await r.score([1, 2, 10**6])
    assert gen.token_ids == eng.generate(ts[2][:7], max_tokens=6, temperature=0.0, ignore_eos=True)[0].token_ids
    for t, x in zip(ts, res):
        check_scores(x, hf_rows(hf_model, t)[0], t, TOP)
        assert set(x.models[1:]) == {"m"}
    check_scores(wide, ref_lp, ts[0], MAX_LOGPROBS)
    assert abs(res[0].total - sum(lp.logprob for lp in res[0].logprobs[1:])) < 1e-9


@pytest.mark.parametrize("policy", ["random", "rstitch", "r2r", "citer", "colm", "ensemble", "query"])
async def test_identical_models_under_every_policy_equal_the_single_model(tiny_qwen3, ref, tmp_path, policy):
    ts = texts(ref)
    args, names = policy_cases(tiny_qwen3, ref, tmp_path)[policy]
    async with Router({"m": str(tiny_qwen3)}, RouterConfig(policy="single")) as r:
        single = [await r.score(t, top_logprobs=TOP) for t in ts]
    async with Router({n: str(tiny_qwen3) for n in names},
                      RouterConfig(entry=names[0], policy=policy, policy_args=args)) as r:
        before = r.kv_usage()
        res = await asyncio.gather(*(r.score(t, top_logprobs=TOP) for t in ts))
        assert {n: (u.pages_used, u.pages_cached) for n, u in r.kv_usage().items()} == \
            {n: (u.pages_used, u.pages_cached) for n, u in before.items()}
    for x, y in zip(res, single):
        check_same(x, y)
    used = {m for x in res for m in x.models[1:]}
    assert used == set(names) if policy != "query" else used <= set(names), (policy, used)


def reference(hf_models, policy: Policy, ids: list[int]) -> tuple[list[float | None], list[int | None]]:
    """The slow reference: generation with each token forced, one step per position. Each step's
    logits and hidden states come from transformers over the committed prefix of the model whose
    turn it is; the policy is called as the runtime calls it while generating (route on a batch of
    one; send when it moves; receive on the peer), the request's prompt being the first token."""
    M, L = len(hf_models), len(ids)
    committed, trace, seen, state = ids[:1], [], [0] * M, [{} for _ in range(M)]
    cur, seen[0] = 0, 1
    values: list[float | None] = [None] * L
    writer: list[int | None] = [None] * L
    while len(committed) < L:
        p = len(committed)
        logits, hidden = hf_forward(hf_models[cur], committed)
        view = ReqView("ref", cur, committed, 1, ids[p], tuple(seen), trace, state[cur])
        d = int(list(policy.route(StepResult(cur, logits[-1:], torch.tensor([ids[p]]), hidden[-1:], [view])))[0])
        value = float(torch.log_softmax(logits[-1], dim=-1)[ids[p]])
        if d == STAY:
            committed.append(ids[p])
            trace.append(cur)
            values[p], writer[p], seen[cur] = value, cur, len(committed)
            continue
        target = policy.peers(cur)[d - 1]
        pr = policy.send(view._replace(peer=target))
        if pr.tokens[len(committed) - seen[target]:]:
            committed.append(ids[p])
            trace.append(cur)
            values[p], writer[p] = value, cur
        got = policy.receive(pr, ReqView("ref", target, committed, 1, None, tuple(seen), trace, state[target]))
        seen[target] += len(got)
        cur = target
    return values, writer


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_other"), seed=1)


@pytest.mark.parametrize("policy", ["rstitch", "random", "citer"])
async def test_routed_score_equals_a_token_by_token_reference(tiny_qwen3, other_model, hf_model, ref, tmp_path,
                                                              policy):
    ts = texts(ref, 4)
    large = transformers.AutoModelForCausalLM.from_pretrained(other_model, dtype=torch.float32).eval()
    if policy == "rstitch":  # about the median entropy, so both models write; in the widest gap between
        # the two models' entropies there, so no position sits within float noise of the threshold
        ent = torch.cat([normalized_entropy(hf_rows(m, t)[0]) for m in (hf_model, large) for t in ts]).sort().values
        mid = ent[len(ent) * 2 // 5:len(ent) * 3 // 5]
        gap = int((mid[1:] - mid[:-1]).argmax())
        args = {"tau": float(mid[gap] + mid[gap + 1]) / 2}
    elif policy == "random":  # coins from the prompt (the first token), so the reference draws the same
        args = {"p": 0.4, "seed": 3, "key": "prompt"}
    else:
        args = policy_cases(tiny_qwen3, ref, tmp_path)["citer"][0]
    async with Router({"small": str(tiny_qwen3), "large": str(other_model)},
                      RouterConfig(entry="small", policy=policy, policy_args=args)) as r:
        before = r.kv_usage()
        got = await asyncio.gather(*(r.score(t, top_logprobs=2) for t in ts))
        assert r.kv_usage() == before
    writers = set()
    for t, x in zip(ts, got):
        pol = make_policy(policy, args)
        pol.bind(["small", "large"])
        pol.setup([ModelInfo(n, str(p), 512, 64, "cpu") for n, p in (("small", tiny_qwen3), ("large", other_model))])
        values, writer = reference([hf_model, large], pol, t)
        assert x.models == [None if w is None else ("small", "large")[w] for w in writer]
        assert max(abs(a.logprob - b) for a, b in zip(x.logprobs[1:], values[1:])) < TOL
        writers |= set(writer[1:])
    assert writers == {0, 1}  # both models scored positions, with values of their own


async def test_policies_that_cannot_be_replayed_are_refused_by_name():
    """A send that commits a token its model did not sample, and a receive that takes less than
    the model has not seen, cannot be scored teacher-forced: a RouterError naming the policy."""
    from engines.sim import SimEngine

    class Padding(Policy):
        name = "padding"

        def route(self, result):
            return [1 if result.model == 0 else STAY for _ in result.reqs]

        def send(self, req):
            return PeerReq(req.rid, req.token_ids[req.seen[req.peer]:] + [req.sampled, 65], loc=req.loc)

    class Lagging(Padding):
        name = "lagging"

        def send(self, req):
            return PeerReq(req.rid, req.token_ids[req.seen[req.peer]:], loc=req.loc)

        def receive(self, peer_req, req):
            return peer_req.tokens[:-1]  # one short of what the peer has not seen

    async with Router({"a": SimEngine(latency_a=0), "b": SimEngine(latency_a=0)}, RouterConfig(policy="single")) as r:
        for pol, what in ((Padding(), "send commits tokens model 'a' did not sample"), (Lagging(), "receive on 'b'")):
            with pytest.raises(RouterError, match=f"policy '{pol.name}'.{what}"):
                await r.score([5, 6, 7, 8], policy=pol)
        # a simulated model scores too: its values are those of its generation's tokens
        gen = await r.generate([5, 6, 7, 8], max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2)
        scored = await r.score([5, 6, 7, 8] + gen.token_ids, top_logprobs=2)
        assert scored.logprobs[4:] == gen.logprobs and scored.models[4:] == gen.models
        assert {u.pages_used for u in r.kv_usage().values()} == {0}


async def test_a_full_kv_pool_is_unavailable_for_now_and_the_next_score_goes_through(tiny_qwen3, hf_model, ref):
    """Scoring takes its pages when the replay reaches a model; a pool without enough free pages
    then is a RouterUnavailable (retry), and nothing is left held."""
    from aiorouter import RouterUnavailable
    t = texts(ref, 1)[0][:60]  # 59 positions: 4 pages of 16, the whole pool
    eng = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=64, page_size=16)
    async with Router({"m": eng}, RouterConfig(policy="single")) as r:
        first, second = await asyncio.gather(r.score(t), r.score(t), return_exceptions=True)
        assert isinstance(second, RouterUnavailable) and "model 'm' cannot score this text now" in str(second)
        assert r.kv_usage()["m"].pages_used == 0
        check_scores(await r.score(t), hf_rows(hf_model, t)[0], t, 0)
    check_scores(first, hf_rows(hf_model, t)[0], t, 0)


# -- through the server, with the openai client (lm-evaluation-harness's loglikelihood requests) -----------
async def test_server_echo_with_logprobs_as_lm_eval_sends_it(tiny_chat_model):
    import openai
    from test_server import pair, running_server
    tok = transformers.AutoTokenizer.from_pretrained(tiny_chat_model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()
    prompt = "Once upon a time there was a cat"
    ids = tok.encode(prompt)
    ref_lp = hf_rows(hf, ids)[0]
    greedy = int(hf_rows(hf, ids)[0][-1].argmax())

    def text(i: int) -> str:
        return tok.decode([i])

    async with running_server(pair(tiny_chat_model), policy_args={"p": 0.4, "seed": 3}) as (url, server, router):
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        before = router.kv_usage()
        r0 = await c.completions.create(model="aiorouter", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        assert router.kv_usage() == before  # scoring alone: every page back, nothing new in the prefix cache
        ch = r0.choices[0]
        assert ch.text == prompt and ch.finish_reason == "length" and r0.usage.completion_tokens == 0
        lp = ch.logprobs
        assert lp.tokens == [text(i) for i in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for p in range(1, len(ids)):
            assert abs(lp.token_logprobs[p] - float(ref_lp[p - 1, ids[p]])) < TOL
            best = int(ref_lp[p - 1].argmax())
            assert set(lp.top_logprobs[p]) == {text(best), text(ids[p])}
        assert lp.text_offset == [sum(len(text(i)) for i in ids[:p]) for p in range(len(ids))]
        assert set(lp.model_extra["aiorouter_models"][1:]) <= {"small", "large"}

        # lm-eval's form: a batch of token-id prompts, max_tokens 1, the continuation read from [ctxlen:-1]
        batch = [ids, ids[:5]]
        r1 = await c.completions.create(model="aiorouter", prompt=batch, max_tokens=1, echo=True, logprobs=1,
                                        temperature=0)
        assert len(r1.choices) == 2
        for chc, p_ids in zip(r1.choices, batch):
            lp1 = chc.logprobs
            assert len(lp1.tokens) == len(p_ids) + 1 and lp1.token_logprobs[0] is None
            assert chc.text.startswith(tok.decode(p_ids))
            for p in range(1, len(p_ids)):
                assert abs(lp1.token_logprobs[p] - float(hf_rows(hf, p_ids)[0][p - 1, p_ids[p]])) < TOL
        gen = r1.choices[0].logprobs
        assert gen.tokens[-1] == text(greedy) and abs(gen.token_logprobs[-1] - float(ref_lp[-1, greedy])) < TOL
        assert gen.text_offset[-1] == len(tok.decode(ids))  # the completion's text starts past the prompt's

        # with n, best_of, no alternatives (logprobs 0) and a policy chosen per request: each choice
        # echoes the prompt's text and values
        r2 = await c.completions.create(model="aiorouter", prompt=prompt, max_tokens=2, echo=True, logprobs=0, n=2,
                                        best_of=3, temperature=1.0, seed=1,
                                        extra_body={"ignore_eos": True, "routing": {"policy": "single"}})
        assert len(r2.choices) == 2 and r2.usage.completion_tokens == 4
        for chc in r2.choices:
            lp2 = chc.logprobs
            assert chc.text.startswith(prompt) and len(lp2.tokens) == len(ids) + 2
            assert lp2.model_extra["aiorouter_models"] == [None] + ["small"] * (len(ids) + 1)
            assert lp2.token_logprobs[:len(ids)] == lp.token_logprobs[:1] + [
                pytest.approx(v, abs=TOL) for v in lp.token_logprobs[1:]]
            assert all(d == {t: v} for d, t, v in zip(lp2.top_logprobs[1:], lp2.tokens[1:], lp2.token_logprobs[1:]))

        plain = await c.completions.create(model="aiorouter", prompt=prompt, max_tokens=3, echo=True,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert plain.choices[0].text.startswith(prompt) and len(plain.choices[0].text) > len(prompt)
        assert plain.choices[0].logprobs is None and plain.usage.completion_tokens == 3

        for body, field in (({"max_tokens": 0}, "max_tokens 0 is allowed only with echo"),
                            ({"max_tokens": 0, "echo": True, "prompt": [5, 10**6]}, "outside the vocabulary"),
                            ({"max_tokens": 2, "echo": True, "stream": True}, "echo cannot stream"),
                            ({"max_tokens": -1, "echo": True}, "max_tokens")):
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(model="aiorouter", **{"prompt": prompt, **body})
            assert field in e.value.body["message"], (body, e.value.body)
        assert router.num_active == 0
        assert {u.pages_used for u in router.kv_usage().values()} == {0}
