"""More than one completion (issue 40, item 3): `n` on both endpoints, `best_of` and a batch of
prompts on completions, through the server with the `openai` package. A prompt's choices share its
prefill through the prefix cache, as the server's metrics show."""
from __future__ import annotations

import re

import aiohttp
import openai
import pytest

from engines.config import EngineConfig
from test_server import running_server

LONG = "Once upon a time, in a small village by the sea, there lived an old fisherman and his cat. " * 4


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


async def counters(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return {name: float(v) for name, v in re.findall(
        r'^aiorouter_(prefill_tokens|prefix_cache_hit_tokens)_total\{model="m"\} (\S+)$', text, re.M)}


SAMPLED = dict(max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})


async def test_n_choices_prefill_their_prompt_once(tiny_chat_model):
    page = EngineConfig().page_size
    async with running_server({"m": str(tiny_chat_model)}, policy="single") as (url, server, router):
        c = client(url)
        n_prompt = len(router.prompt_ids(LONG))
        assert n_prompt > 4 * page
        before = await counters(url)
        r = await c.completions.create(model="aiorouter", prompt=LONG, n=4, seed=5, **SAMPLED)
        after = await counters(url)
        assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 24)  # the prompt counted once
        assert sum(r.usage.model_extra["per_model"].values()) == 24
        # the first choice prefilled the prompt; the three others found its full pages in the cache
        shared = (n_prompt - 1) // page * page
        assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 3 * shared
        assert after["prefill_tokens"] - before["prefill_tokens"] == n_prompt + 3 * (n_prompt - shared)
        # choice k is the request with seed 5 + k (vLLM's), alone
        for k, ch in enumerate(r.choices):
            one = await c.completions.create(model="aiorouter", prompt=LONG, seed=5 + k, **SAMPLED)
            assert ch.text == one.choices[0].text
        assert len({ch.text for ch in r.choices}) > 1
        assert router.num_active == 0


async def test_n_chat_choices_stream_each_with_its_index(tiny_chat_model):
    msgs = [{"role": "user", "content": "Tell me a story about a cat."}]
    async with running_server({"m": str(tiny_chat_model)}, policy="single") as (url, server, router):
        c = client(url)
        whole = await c.chat.completions.create(model="aiorouter", messages=msgs, n=3, seed=9, **SAMPLED)
        stream = await c.chat.completions.create(model="aiorouter", messages=msgs, n=3, seed=9, stream=True,
                                                 stream_options={"include_usage": True}, **SAMPLED)
        chunks = [ch async for ch in stream]
        texts, roles, reasons = {}, {}, {}
        for ch in chunks:
            for choice in ch.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                if choice.delta.role:
                    roles[choice.index] = choice.delta.role
                if choice.finish_reason:
                    reasons[choice.index] = choice.finish_reason
        assert texts == {ch.index: ch.message.content for ch in whole.choices} and len(texts) == 3
        assert roles == {0: "assistant", 1: "assistant", 2: "assistant"} and reasons == {0: "length", 1: "length",
                                                                                          2: "length"}
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 18
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
        assert router.num_active == 0


async def test_a_batch_of_prompts_numbers_its_choices_prompt_by_prompt(tiny_chat_model):
    prompts = ["The capital of France is", "Write a haiku about the sea.", "One, two, three,"]
    async with running_server({"m": str(tiny_chat_model)}, policy="single") as (url, server, router):
        c = client(url)
        r = await c.completions.create(model="aiorouter", prompt=prompts, n=2, seed=3, **SAMPLED)
        assert [ch.index for ch in r.choices] == list(range(6))
        for i, p in enumerate(prompts):
            for j in range(2):
                one = await c.completions.create(model="aiorouter", prompt=p, seed=3 + j, **SAMPLED)
                assert r.choices[2 * i + j].text == one.choices[0].text, (i, j)
        assert r.usage.prompt_tokens == sum(len(router.prompt_ids(p)) for p in prompts)
        assert r.usage.completion_tokens == 36
        ids = [router.prompt_ids(p) for p in prompts[:2]]  # token ids too
        r2 = await c.completions.create(model="aiorouter", prompt=ids, seed=3, **SAMPLED)
        assert [ch.text for ch in r2.choices] == [r.choices[0].text, r.choices[2].text]
        with pytest.raises(openai.BadRequestError) as e:  # one bad prompt refuses the whole batch
            await c.completions.create(model="aiorouter", prompt=[[5, 6], [10**7]], max_tokens=2)
        assert "outside the vocabulary" in e.value.body["message"]
        assert router.num_active == 0


async def test_best_of_returns_the_most_probable_choices(tiny_chat_model):
    async with running_server({"m": str(tiny_chat_model)}, policy="single") as (url, server, router):
        c = client(url)
        r = await c.completions.create(model="aiorouter", prompt=LONG, n=2, best_of=4, seed=21, **SAMPLED)
        assert [ch.index for ch in r.choices] == [0, 1] and all(ch.logprobs is None for ch in r.choices)
        singles = []
        for k in range(4):  # each candidate alone, with its log probabilities
            one = await c.completions.create(model="aiorouter", prompt=LONG, seed=21 + k, logprobs=0, **SAMPLED)
            singles.append((sum(one.choices[0].logprobs.token_logprobs), one.choices[0].text))
        best = sorted(singles, key=lambda s: -s[0])[:2]
        assert [ch.text for ch in r.choices] == [text for _, text in best]
        assert r.usage.completion_tokens == 12  # the choices returned, as vLLM counts them
        assert router.num_active == 0


async def test_a_server_holds_requests_to_its_max_choices(tiny_chat_model):
    """`--max-choices`: a request asking for more choices (n, best_of, prompts times n) is a 400 naming
    the field, and the server answers the next one."""
    async with running_server({"m": str(tiny_chat_model)}, policy="single", max_choices=4) as (url, _, _):
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for kw, field in (({"n": 5}, "n"), ({"n": 1, "extra_body": {"best_of": 5}}, "best_of")):
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(model="aiorouter", prompt="Hi", max_tokens=2, **kw)
            assert e.value.body["param"] == field and "at most 4" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="aiorouter", prompt=["a", "b", "c"], n=2, max_tokens=2)
        assert e.value.body["param"] == "prompt"
        r = await c.completions.create(model="aiorouter", prompt=["a", "b"], n=2, max_tokens=2)
        assert len(r.choices) == 4
