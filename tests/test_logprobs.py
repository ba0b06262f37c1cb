"""Log probabilities of generated tokens (issue 40, item 1): each token's, under the model that
wrote it, from the step's raw logits; equal to transformers' log_softmax of the same model, and
with identical models under every routing policy equal to the single model's; computed only for
the rows that ask."""
from __future__ import annotations

import asyncio

import pytest
import torch
import transformers

from aiorouter import Router, RouterConfig
from engines import Engine, SamplingParams
from engines.logprobs import MAX_LOGPROBS
from policies.checkpoints import load_embedding, save_router
from policies.networks import CITERRouter, R2RRouter
from policies.rstitch import normalized_entropy
from test_policies import MAX_TOK, N_REQ, _median, ref  # noqa: F401 (ref: the fixture, used by name)

TOL = 1e-4  # fp32, against transformers
TOP = 3


def hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: transformers' log_softmax at each position that predicted an output token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    n = len(prompt)
    return torch.log_softmax(logits[n - 1:n - 1 + len(output)], dim=-1)


def check_against(ref_lp: torch.Tensor, output: list[int], got, k: int) -> None:
    """`got` (TokenLogprobs, one per output token) against the reference distribution rows."""
    assert len(got) == len(output) == ref_lp.shape[0]
    for row, tok, lp in zip(ref_lp, output, got):
        assert abs(lp.logprob - float(row[tok])) < TOL, (lp.logprob, float(row[tok]))
        # The j-th entry is a token whose reference log probability is the j-th largest: the same id
        # but where two reference values lie within TOL, which the spec's 1e-4 cannot order (on the
        # AVX2 VM the engine's top 20 and transformers' differed at rank 17, ids 169 and 334).
        vals, _ = torch.topk(row, k)
        got_ids = [i for i, _ in lp.top]
        assert len(got_ids) == k and len(set(got_ids)) == k
        assert all(abs(float(row[i]) - b) < TOL for i, b in zip(got_ids, vals.tolist())), (got_ids, vals.tolist())
        assert all(abs(a - float(row[i])) < TOL for i, a in lp.top)


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, torch_dtype=torch.float32).eval()


async def test_single_policy_equals_transformers_greedy_and_sampled(tiny_qwen3, hf_model, ref):
    ps = ref[0][:6]
    async with Router({"m": str(tiny_qwen3)}, RouterConfig(policy="single")) as r:
        greedy = await asyncio.gather(*(r.generate(p, max_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=5)
                                        for p in ps))
        # sampled with temperature and top-k: the log probabilities are still the model's raw ones
        sampled = await asyncio.gather(*(r.generate(p, max_tokens=10, ignore_eos=True, temperature=1.3, top_k=4,
                                                    seed=i, logprobs=True, top_logprobs=MAX_LOGPROBS)
                                         for i, p in enumerate(ps)))
        plain = await r.generate(ps[0], max_tokens=4, ignore_eos=True)
        # a logit_bias that forces token 7: the values stay the model's, before any sampling control
        biased = await r.generate(ps[0], max_tokens=4, ignore_eos=True, logit_bias={7: 100.0}, logprobs=True,
                                  top_logprobs=2)
    for p, res in zip(ps, greedy):
        check_against(hf_logprobs(hf_model, p, res.token_ids), res.token_ids, res.logprobs, 5)
        assert all(lp.top[0][0] == t for lp, t in zip(res.logprobs, res.token_ids))  # greedy: the most probable
    for p, res in zip(ps, sampled):
        check_against(hf_logprobs(hf_model, p, res.token_ids), res.token_ids, res.logprobs, MAX_LOGPROBS)
    # top-k 4 of a temperature above 1: some token past the most probable one was drawn
    assert any(lp.top[0][0] != t for res in sampled for lp, t in zip(res.logprobs, res.token_ids))
    assert plain.logprobs is None
    assert biased.token_ids == [7] * 4 and all(lp.logprob < -1.0 for lp in biased.logprobs)
    check_against(hf_logprobs(hf_model, ps[0], biased.token_ids), biased.token_ids, biased.logprobs, 2)


def test_engine_alone_returns_them_and_computes_only_for_the_rows_that_ask(tiny_qwen3, hf_model, ref, monkeypatch):
    from engines import runner as runner_module  # (the module: the layering test keeps `.runner` for the engine's)
    calls = []
    real = runner_module.step_logprobs
    monkeypatch.setattr(runner_module, "step_logprobs", lambda *a: calls.append(a[2]) or real(*a))
    ps = ref[0][:4]
    eng = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=4096)
    out = eng.generate(ps, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert calls == [] and all(o.logprobs is None for o in out)  # nobody asked: never called
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=k) for k in (None, 0, 2, None)]
    out = eng.generate(ps, params)
    # one call a step (a prefill, then a decode per token), each over the four rows, in batch order
    assert len(calls) == 6 and all(sorted(c, key=str) == sorted([None, 0, 2, None], key=str) for c in calls)
    assert out[0].logprobs is None and out[3].logprobs is None
    for p, o, k in ((ps[1], out[1], 0), (ps[2], out[2], 2)):
        check_against(hf_logprobs(hf_model, p, o.token_ids), o.token_ids, o.logprobs, k)
    calls.clear()
    eng.generate(ps[:1], max_tokens=3, temperature=0.0)
    assert calls == []  # the count went back to 0: asking once costs nothing afterwards


@pytest.mark.gpu
def test_cuda_step_computes_them_on_the_device_and_reads_them_with_the_tokens(tiny_qwen3, hf_model, ref):
    """The CUDA path (`StepLogprobs.to_host`, read after the step's one event), graphs and eager:
    the same values as transformers' on the host."""
    ps = ref[0][:4]
    for graphs in (True, False):
        eng = Engine.from_pretrained(tiny_qwen3, device="cuda", num_kv_tokens=4096, cuda_graphs=graphs)
        params = [SamplingParams(max_tokens=8, temperature=t, seed=1, ignore_eos=True, logprobs=k)
                  for t, k in ((0.0, 5), (0.9, 0), (0.0, None), (1.2, MAX_LOGPROBS))]
        for p, o, sp in zip(ps, eng.generate(ps, params), params):
            if sp.logprobs is None:
                assert o.logprobs is None
            else:
                check_against(hf_logprobs(hf_model, p, o.token_ids), o.token_ids, o.logprobs, sp.logprobs)


def policy_cases(path, ref, tmp_path) -> dict[str, tuple[dict, tuple[str, ...]]]:
    """Every built-in routing policy between identical models, with arguments under which both
    models write tokens on these prompts (as tests/test_policies.py sets them)."""
    ps, _, (logits, tokens, hidden), first_logits = ref
    torch.manual_seed(0)
    r2r = R2RRouter(load_embedding(path), hidden.shape[1], hidden_dims=[32, 32]).eval()
    save_router(r2r, tmp_path / "r2r.pt", _median(r2r.prob(hidden, tokens, logits)))
    torch.manual_seed(1)
    citer = CITERRouter(hidden.shape[1]).eval()
    tau = _median(citer.prob(hidden))
    save_router(citer, tmp_path / "citer.pt", tau)
    torch.manual_seed(2)
    w = torch.randn(hidden.shape[1])
    torch.save({"weight": w, "bias": 0.0}, tmp_path / "defer.pt")
    scores = normalized_entropy(first_logits).sort().values
    pair = ("small", "large")
    return {
        "random": ({"p": 0.4, "seed": 3}, pair),
        "rstitch": ({"tau": _median(normalized_entropy(logits))}, pair),
        "r2r": ({"router": str(tmp_path / "r2r.pt"), "small_path": str(path)}, pair),
        "citer": ({"router": str(tmp_path / "citer.pt"), "tau": tau}, pair),
        "colm": ({"head": str(tmp_path / "defer.pt"), "eta": _median(torch.sigmoid(hidden @ w))}, pair),
        "ensemble": ({"weights": [0.5, 0.3, 0.2], "seed": 4}, ("a", "b", "c")),
        "query": ({"thresholds": float(scores[N_REQ // 2 - 1:N_REQ // 2 + 1].mean())}, pair),
    }


@pytest.mark.parametrize("policy", ["random", "rstitch", "r2r", "citer", "colm", "ensemble", "query"])
async def test_identical_models_under_every_policy_equal_the_single_model(tiny_qwen3, ref, tmp_path, policy):
    ps, ids, _, _ = ref
    args, names = policy_cases(tiny_qwen3, ref, tmp_path)[policy]
    single = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=8192).generate(
        ps, max_tokens=MAX_TOK, temperature=0.0, ignore_eos=True, logprobs=TOP)
    async with Router({n: str(tiny_qwen3) for n in names},
                      RouterConfig(entry=names[0], policy=policy, policy_args=args)) as r:
        res = await asyncio.gather(*(r.generate(p, max_tokens=MAX_TOK, temperature=0.0, ignore_eos=True,
                                                logprobs=True, top_logprobs=TOP) for p in ps))
    assert [x.token_ids for x in res] == ids == [o.token_ids for o in single]
    assert len({m for x in res for m in x.models}) == len(names), policy  # every model wrote tokens
    for x, o in zip(res, single):
        assert len(x.logprobs) == len(x.token_ids)
        for a, b in zip(x.logprobs, o.logprobs):  # whichever model wrote the token
            assert abs(a.logprob - b.logprob) < 1e-5 and [i for i, _ in a.top] == [i for i, _ in b.top]
            assert max(abs(u - v) for (_, u), (_, v) in zip(a.top, b.top)) < 1e-5


async def test_stream_events_carry_them_and_bad_values_are_refused(tiny_qwen3, ref):
    p = ref[0][0]
    async with Router({"small": str(tiny_qwen3), "large": str(tiny_qwen3)},
                      RouterConfig(entry="small", policy="random", policy_args={"p": 0.5, "seed": 1})) as r:
        evs = [e async for e in r.stream(p, max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2)]
        whole = await r.generate(p, max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2)
        # (the coins are per request: another request routes otherwise, to the same tokens and values)
        assert [e.token_id for e in evs] == whole.token_ids
        assert {e.model for e in evs} == {"small", "large"}
        for e, lp in zip(evs, whole.logprobs):
            assert len(e.logprob.top) == 2 and abs(e.logprob.logprob - lp.logprob) < 1e-5
        bare = [e async for e in r.stream(p, max_tokens=4, ignore_eos=True)]
        assert all(e.logprob is None for e in bare)
        for kw, field in (({"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
                          ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
                          ({"logprobs": True, "top_logprobs": -1}, "top_logprobs")):
            with pytest.raises(ValueError, match=field):
                r.submit(p, **kw)
        assert r.num_active == 0
    with pytest.raises(ValueError, match="logprobs must be an integer"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)


# -- through the server, with the openai client --------------------------------------------------------
async def test_server_chat_and_completions_with_the_openai_client(tiny_chat_model):
    import openai
    from test_server import pair, running_server
    tok = transformers.AutoTokenizer.from_pretrained(tiny_chat_model)
    msgs = [{"role": "user", "content": "Tell me a story about a cat."}]
    eng = Engine.from_pretrained(tiny_chat_model, num_kv_tokens=2048)
    chat_ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    chat_ids = chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"]
    ref_chat = eng.generate(chat_ids, max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=TOP)[0]
    ref_cmpl = eng.generate("Once upon a time", max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)[0]
    del eng
    def text(i: int) -> str:  # a token's text, as the server names it
        return tok.decode([i])

    extra = {"ignore_eos": True}
    async with running_server(pair(tiny_chat_model), policy_args={"p": 0.4, "seed": 3}) as (url, server, router):
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = await c.chat.completions.create(model="aiorouter", messages=msgs, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=TOP, extra_body=extra)
        content = r.choices[0].logprobs.content
        assert [e.token for e in content] == [text(i) for i in ref_chat.token_ids]
        for e, lp in zip(content, ref_chat.logprobs):
            assert abs(e.logprob - lp.logprob) < 1e-5 and e.bytes == list(e.token.encode())
            assert [t.token for t in e.top_logprobs] == [text(i) for i, _ in lp.top]
            assert all(abs(t.logprob - v) < 1e-5 for t, (_, v) in zip(e.top_logprobs, lp.top))
        models = [e.model_extra["aiorouter_model"] for e in content]
        assert {m: models.count(m) for m in ("small", "large")} == r.usage.model_extra["per_model"]
        assert set(models) == {"small", "large"}

        stream = await c.chat.completions.create(model="aiorouter", messages=msgs, max_tokens=12, temperature=0,
                                                 logprobs=True, top_logprobs=TOP, stream=True, extra_body=extra)
        streamed = [(e, ch.model_extra["aiorouter"]["model"]) for ch in [ch async for ch in stream]
                    if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
        # the same tokens and values (this request's own coins route it otherwise), each entry naming
        # its chunk's model
        assert [(e.token, e.logprob) for e, _ in streamed] == [(e.token, e.logprob) for e in content]
        assert all(e.model_extra["aiorouter_model"] == m for e, m in streamed)

        cm = await c.completions.create(model="aiorouter", prompt="Once upon a time", max_tokens=12, temperature=0,
                                        logprobs=2, extra_body=extra)
        lp = cm.choices[0].logprobs
        assert lp.tokens == [text(i) for i in ref_cmpl.token_ids]
        assert all(abs(a - b.logprob) < 1e-5 for a, b in zip(lp.token_logprobs, ref_cmpl.logprobs))
        for d, t, b in zip(lp.top_logprobs, ref_cmpl.token_ids, ref_cmpl.logprobs):
            # the two most probable and the sampled token (up to logprobs + 1, as OpenAI's)
            assert set(d) == {text(i) for i, _ in b.top} | {text(t)} and len(d) <= 3
        chunks = [ch async for ch in await c.completions.create(
            model="aiorouter", prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=2, stream=True,
            extra_body=extra)]
        assert all(len(ch.choices[0].logprobs.tokens) == 1 for ch in chunks)  # one chunk a token, empty text too
        assert [ch.choices[0].logprobs.tokens[0] for ch in chunks] == lp.tokens
        # text_offset: where each token's text starts in the answer's text, streamed or not
        starts = [sum(len(ch.choices[0].text) for ch in chunks[:i]) for i in range(len(chunks))]
        assert [ch.choices[0].logprobs.text_offset[0] for ch in chunks] == starts == lp.text_offset
        assert "".join(ch.choices[0].text for ch in chunks) == cm.choices[0].text
        names = lp.model_extra["aiorouter_models"]
        assert len(names) == 12 and {m: names.count(m) for m in ("small", "large")} == cm.usage.model_extra["per_model"]
        plain = await c.completions.create(model="aiorouter", prompt="Once upon a time", max_tokens=2)
        assert plain.choices[0].logprobs is None

        for endpoint, body, field in (
                ("chat", {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
                ("chat", {"top_logprobs": 2}, "top_logprobs"),
                ("completions", {"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
                ("completions", {"logprobs": True}, "logprobs")):
            create = c.chat.completions.create if endpoint == "chat" else c.completions.create
            prompt = {"messages": msgs} if endpoint == "chat" else {"prompt": "hi"}
            with pytest.raises(openai.BadRequestError) as e:
                await create(model="aiorouter", max_tokens=2, **prompt, extra_body=body)
            assert field in e.value.body["message"], (body, e.value.body)
        assert router.num_active == 0


async def test_a_send_that_commits_unsampled_tokens_fails_a_request_that_asked():
    """A policy may commit tokens its model did not sample; their log probabilities are unknown,
    so a request that asked for them fails, naming the policy, and one that did not goes on."""
    from aiorouter import RouterError
    from engines.sim import SimEngine
    from policies import STAY, PeerReq, Policy

    class Padding(Policy):  # every move commits the sampled token and one of its own
        name = "padding"

        def route(self, result):
            return [1 if result.model == 0 else STAY for _ in result.reqs]

        def send(self, req):
            return PeerReq(req.rid, req.token_ids[req.seen[req.peer]:] + [req.sampled, 65], loc=req.loc)

    async with Router({"a": SimEngine(latency_a=0), "b": SimEngine(latency_a=0)}, RouterConfig(policy=Padding())) as r:
        ok = await r.generate([5, 6, 7], max_tokens=6, ignore_eos=True)
        assert ok.token_ids[1] == 65 and ok.models[:2] == ["a", "a"]
        with pytest.raises(RouterError, match="policy 'padding'.send commits tokens model 'a' did not sample"):
            await r.generate([5, 6, 7], max_tokens=6, ignore_eos=True, logprobs=True)
        assert r.num_active == 0
