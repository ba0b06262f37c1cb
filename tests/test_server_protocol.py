"""The ecosystem's protocol (issue 40): vLLM's stream option, endpoints and fields, and what the
server does with fields it does not know; driven by the `openai` client where it can say it."""
from __future__ import annotations

import json
import logging
import shutil
import time

import aiohttp
import openai
import pytest
import transformers

from server.app import _version
from server.schemas import TokenizeResponse
from test_server import KEY, pair, running_server

MSGS = [{"role": "user", "content": "Tell me a story about a cat."}]
IGNORED = "X-Aiorouter-Ignored-Fields"


def client(url: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


# -- stream_options.continuous_usage_stats -----------------------------------------------------------
def check_running_usage(chunks, prompt_tokens: int, max_tokens: int) -> None:
    """Every chunk carries the usage so far: whole, counting up as tokens arrive, ending at the final usage."""
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages), [c for c in chunks if c.usage is None][:1]
    for u in (u.to_dict() for u in usages):
        assert u["prompt_tokens"] == prompt_tokens and u["total_tokens"] == prompt_tokens + u["completion_tokens"]
        assert sum(u["per_model"].values()) == u["completion_tokens"]
    counts = [u.completion_tokens for u in usages]
    assert counts == sorted(counts) and counts[-1] == max_tokens, counts
    # a chunk naming the model that wrote it carries a token: the count rises with each of them
    with_token = [c.usage.completion_tokens for c in chunks if (c.model_extra or {}).get("aiorouter")]
    assert len(with_token) > 1 and all(a < b for a, b in zip(with_token, with_token[1:])), with_token


async def test_continuous_usage_stats_on_every_chunk_chat_and_completions(tiny_chat_model):
    async with running_server(pair(tiny_chat_model)) as (url, server, router):
        c = client(url)
        extra = {"ignore_eos": True}
        whole = await c.chat.completions.create(model="aiorouter", messages=MSGS, max_tokens=12, extra_body=extra)
        stream = await c.chat.completions.create(
            model="aiorouter", messages=MSGS, max_tokens=12, stream=True, extra_body=extra,
            stream_options={"include_usage": True, "continuous_usage_stats": True})
        chunks = [ch async for ch in stream]
        assert chunks[0].usage.completion_tokens == 0  # the role chunk, before any token
        check_running_usage(chunks, whole.usage.prompt_tokens, 12)
        assert chunks[-1].choices == [] and chunks[-1].usage == chunks[-2].usage  # include_usage's closing chunk

        whole = await c.completions.create(model="aiorouter", prompt="Once upon a time", max_tokens=9, extra_body=extra)
        # continuous_usage_stats alone: usage on every chunk, no usage-only chunk at the end
        stream = await c.completions.create(model="aiorouter", prompt="Once upon a time", max_tokens=9, stream=True,
                                            extra_body=extra, stream_options={"continuous_usage_stats": True})
        chunks = [ch async for ch in stream]
        assert all(ch.choices for ch in chunks)
        check_running_usage(chunks, whole.usage.prompt_tokens, 9)
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


# -- /tokenize, /detokenize, /version, /v1/models --------------------------------------------------------
@pytest.fixture(scope="module")
def bos_chat_model(tiny_chat_model, tmp_path_factory):
    """The tiny chat model with a tokenizer that adds a BOS (as Llama's and Gemma's do; SmolLM2's
    adds none), so that add_special_tokens changes the ids."""
    path = tmp_path_factory.mktemp("bos") / "m"
    shutil.copytree(tiny_chat_model, path)
    spec = json.loads((path / "tokenizer.json").read_text())
    bos = next(t["id"] for t in spec["added_tokens"] if t["content"] == "<|im_start|>")
    first = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing", "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [first, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [bos], "tokens": ["<|im_start|>"]}}}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


async def post(s: aiohttp.ClientSession, url: str, body: dict, status: int = 200) -> dict:
    async with s.post(url, json=body) as r:
        out = await r.json()
        assert r.status == status, (body, r.status, out)
        return out


async def test_tokenize_detokenize_version_and_models(bos_chat_model):
    tok = transformers.AutoTokenizer.from_pretrained(bos_chat_model)
    text = "The capital of France is"
    plain = tok.encode(text, add_special_tokens=False)
    assert tok.encode(text) == [tok.bos_token_id, *plain]  # the fixture's tokenizer adds a BOS
    t0 = int(time.time())
    async with running_server(pair(bos_chat_model)) as (url, server, router):
        async with aiohttp.ClientSession() as s:
            out = TokenizeResponse.model_validate(await post(s, url + "/tokenize", {"prompt": text}))
            assert out.tokens == [tok.bos_token_id, *plain] and out.count == len(out.tokens)
            assert out.max_model_len == router.max_model_len > 0 and out.token_strs is None
            # what a completion's prompt is
            c = await client(url).completions.create(model="aiorouter", prompt=text, max_tokens=1)
            assert c.usage.prompt_tokens == out.count
            out = await post(s, url + "/tokenize", {"prompt": text, "add_special_tokens": False,
                                                    "return_token_strs": True})
            assert out["tokens"] == plain and out["token_strs"] == tok.convert_ids_to_tokens(plain)

            chat = await post(s, url + "/tokenize", {"messages": MSGS})
            r = await client(url).chat.completions.create(model="aiorouter", messages=MSGS, max_tokens=1)
            assert chat["count"] == r.usage.prompt_tokens == len(chat["tokens"])  # what a chat's prompt is
            no_prompt = await post(s, url + "/tokenize", {"messages": MSGS, "add_generation_prompt": False})
            n = no_prompt["count"]
            assert n < chat["count"] and chat["tokens"][:n] == no_prompt["tokens"]
            special = await post(s, url + "/tokenize", {"messages": MSGS, "add_special_tokens": True})
            assert special["tokens"] == [tok.bos_token_id, *chat["tokens"]]

            back = await post(s, url + "/detokenize", {"tokens": plain})
            assert back == {"prompt": text}
            vocab = len(tok)
            bad = await post(s, url + "/detokenize", {"tokens": [5, -1, vocab, 10**6]}, 400)
            assert bad["error"]["param"] == "tokens"
            assert f"-1, {vocab}, 1000000 outside the vocabulary [0, {vocab})" in bad["error"]["message"]
            both = await post(s, url + "/tokenize", {"prompt": text, "messages": MSGS}, 400)
            assert "not both" in both["error"]["message"]
            assert "model 'gpt-9' does not exist" in (await post(
                s, url + "/tokenize", {"prompt": text, "model": "gpt-9"}, 404))["error"]["message"]
            chat_only = await post(s, url + "/tokenize", {"messages": MSGS, "chat_template": "{{ 1 }}"}, 400)
            assert chat_only["error"]["message"].startswith("chat_template is not supported by this server")

            async with s.get(url + "/version") as r:
                assert r.status == 200 and await r.json() == {"version": _version()}
        models = await client(url).models.list()
        card = models.data[0]
        assert t0 <= card.created <= time.time()
        assert card.root == str(bos_chat_model) and card.max_model_len == router.max_model_len


async def test_new_endpoints_need_the_api_key(tiny_chat_model):
    async with running_server(pair(tiny_chat_model), api_key=KEY) as (url, server, router):
        async with aiohttp.ClientSession() as s:
            for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
                async with s.post(url + path, json=body) as r:
                    assert r.status == 401
                async with s.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
                    assert r.status == 200


# -- fields the server does not know, and fields it cannot honour --------------------------------------
def ignoring(caplog, name: str) -> int:
    return sum(f"ignoring request field '{name}'" in r.getMessage() for r in caplog.records)


async def test_unknown_fields_are_ignored_with_a_header_and_one_warning_per_name(tiny_chat_model, caplog):
    caplog.set_level(logging.INFO, logger="aiorouter.server")
    async with running_server(pair(tiny_chat_model)) as (url, server, router):
        c = client(url)
        for _ in range(2):
            raw = await c.completions.with_raw_response.create(
                model="aiorouter", prompt="hi", max_tokens=2, extra_body={"frobnicate": 1, "other": {"x": [1]}})
            assert raw.headers[IGNORED] == "frobnicate, other"
            assert raw.parse().usage.completion_tokens >= 1
        assert ignoring(caplog, "frobnicate") == ignoring(caplog, "other") == 1
        assert "--strict" in next(r.getMessage() for r in caplog.records if "'frobnicate'" in r.getMessage())

        # inside stream_options and messages too, on a streamed answer (the header goes out before it)
        body = {"messages": [{"role": "user", "content": "hi", "weight": 2}, {"role": "user", "content": "go"}],
                "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True, "verbose": True},
                "frobnicate": 2}
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
                assert r.headers[IGNORED] == "frobnicate, stream_options.verbose, messages[].weight"
                assert (await r.text()).endswith("data: [DONE]\n\n")
            # a valid request refused for what it asks says which fields it ignored as well
            async with s.post(url + "/v1/completions", json={"prompt": "hi", "model": "gpt-9", "zzz": 0}) as r:
                assert r.status == 404 and r.headers[IGNORED] == "zzz"
            async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}) as r:
                assert r.status == 200 and IGNORED not in r.headers
            async with s.get(url + "/openapi.json") as r:
                doc = await r.json()
        assert ignoring(caplog, "frobnicate") == 1
        assert ignoring(caplog, "stream_options.verbose") == ignoring(caplog, "messages[].weight") == 1
        schemas = doc["components"]["schemas"]
        assert schemas["CompletionRequest"]["additionalProperties"] is True  # the document says they pass
        assert schemas["ChatMessage"]["additionalProperties"] is True
        assert router.num_active == 0


async def test_strict_refuses_unknown_fields_naming_them(tiny_chat_model):
    async with running_server(pair(tiny_chat_model), strict=True) as (url, server, router):
        with pytest.raises(openai.BadRequestError) as e:
            await client(url).completions.create(model="aiorouter", prompt="hi", max_tokens=2,
                                                 extra_body={"frobnicate": 1})
        assert e.value.body["param"] == "frobnicate" and "unknown field" in e.value.body["message"]
        async with aiohttp.ClientSession() as s:
            for body, where in (
                    ({"messages": MSGS, "stream": True, "stream_options": {"verbose": 1}}, "stream_options.verbose"),
                    ({"messages": [{"role": "user", "content": "hi", "weight": 2}]}, "messages.0.weight")):
                out = await post(s, url + "/v1/chat/completions", body, 400)
                assert out["error"]["param"] == where and out["error"]["message"].startswith(f"{where}: unknown field")
            out = await post(s, url + "/tokenize", {"prompt": "hi", "frobnicate": 1}, 400)
            assert out["error"]["param"] == "frobnicate"
            await post(s, url + "/v1/completions", {"prompt": "hi", "max_tokens": 1, "repetition_penalty": 1.0})
            async with s.get(url + "/openapi.json") as r:
                schemas = (await r.json())["components"]["schemas"]
        assert schemas["CompletionRequest"]["additionalProperties"] is False
        assert schemas["StreamOptions"]["additionalProperties"] is False


# a known field at a value the server cannot honour: 400 naming it
UNHONOURED = [
    ("completions", "use_beam_search", True),
    ("completions", "structural_tag", "{}"),  # structured outputs are honoured (tests/test_structured.py)
    ("completions", "add_special_tokens", False),
    ("completions", "priority", 1),
    ("completions", "cache_salt", "tenant-a"),
    ("chat", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("chat", "tool_choice", "required"),
    ("chat", "add_generation_prompt", False),
    ("chat", "continue_final_message", True),
    ("chat", "echo", True),
    ("chat", "reasoning_effort", "low"),
    ("chat", "service_tier", "flex"),
]
# the same fields at their neutral values pass, and are not reported as ignored
NEUTRAL = {"repetition_penalty": 1.0, "min_tokens": 0, "stop_token_ids": [], "use_beam_search": False,
           "skip_special_tokens": True, "response_format": {"type": "text"}, "priority": 0, "request_id": "r-1",
           "metadata": {"run": "7"}}
CHAT_NEUTRAL = {"tools": [], "tool_choice": "none", "parallel_tool_calls": True, "add_generation_prompt": True,
                "echo": False, "top_logprobs": 0, "service_tier": "auto", "store": False}


async def test_known_fields_pass_at_their_neutral_value_only(tiny_chat_model, caplog):
    caplog.set_level(logging.INFO, logger="aiorouter.server")
    async with running_server(pair(tiny_chat_model)) as (url, server, router):
        c = client(url)
        # vLLM's `bench serve` sends repetition_penalty 1.0 with every completion
        raw = await c.completions.with_raw_response.create(model="aiorouter", prompt="hi", max_tokens=2,
                                                           extra_body=NEUTRAL)
        assert IGNORED not in raw.headers and raw.parse().id == "cmpl-r-1"  # vLLM's id from request_id
        r = await c.chat.completions.create(model="aiorouter", messages=MSGS, max_tokens=2,
                                            extra_body={**NEUTRAL, **CHAT_NEUTRAL})
        assert r.id == "chatcmpl-r-1" and r.usage.completion_tokens >= 1
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="aiorouter", messages=MSGS, max_tokens=2, tools=[
                {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}])
        assert e.value.body["param"] == "tools"
        assert e.value.body["message"].startswith("tools is not supported by this server")
        async with aiohttp.ClientSession() as s:
            for endpoint, field, value in UNHONOURED:
                body = {"prompt": "hi"} if endpoint == "completions" else {"messages": MSGS}
                out = await post(s, f"{url}/v1/{endpoint.replace('chat', 'chat/completions')}",
                                 {**body, "max_tokens": 2, field: value}, 400)
                assert out["error"]["param"] == field, (field, out)
                assert out["error"]["message"].startswith(f"{field} is not supported by this server"), out
            out = await post(s, url + "/v1/chat/completions", {"messages": [
                {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function"}]}]}, 400)
            assert out["error"]["param"] == "messages.0.tool_calls"
        assert not any("ignoring request field" in r.getMessage() for r in caplog.records)
        # each refusal is one log line with its status and reason
        refused = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]
        assert len(refused) == len(UNHONOURED) + 2, refused
        assert any(line.startswith("refused POST /v1/completions from 127.0.0.1: 400 use_beam_search is not "
                                   "supported by this server") for line in refused), refused
        assert all("\n" not in line for line in refused)
        assert router.num_active == 0


async def test_refused_requests_are_logged_with_status_and_reason(tiny_chat_model, caplog):
    caplog.set_level(logging.INFO, logger="aiorouter.server")
    async with running_server(pair(tiny_chat_model), api_key=KEY) as (url, server, router):
        auth = {"Authorization": f"Bearer {KEY}"}
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"prompt": "hi"}) as r:
                assert r.status == 401
            async with s.post(url + "/v1/completions", data=b"x", headers={**auth, "Content-Type": "text/plain"}) as r:
                assert r.status == 415
            async with s.post(url + "/v1/completions", json={"prompt": "hi", "model": "gpt-9"}, headers=auth) as r:
                assert r.status == 404
            async with s.get(url + "/v2/nothing", headers=auth) as r:
                assert r.status == 404
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]
    assert [line.split(": ", 1)[1].split(" ")[0] for line in lines] == ["401", "415", "404", "404"], lines
    assert "missing or invalid API key" in lines[0] and "Content-Type must be application/json" in lines[1]
    assert "model 'gpt-9' does not exist" in lines[2] and lines[3].startswith("refused GET /v2/nothing")
