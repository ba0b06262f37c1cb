"""The HTTP server on a loopback port, driven by the official `openai` client."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys

import json
import shutil

import aiohttp
import openai
import pytest
from aiohttp import web

from aiorouter import Router, RouterConfig
from bench.common import free_port, wait_healthy
from engines import Engine
from server.app import Server, ServerConfig
from server.sampling import SamplingDefaults

KEY = "sk-test"


@contextlib.asynccontextmanager
async def running_server(models, policy="random", policy_args=None, ready=True, faults=None, **cfg):
    router = Router(models, RouterConfig(policy=policy, policy_args=policy_args, kv_memory_gb=0.05, faults=faults))
    server = Server(router, ServerConfig(**cfg))
    runner = web.AppRunner(server.app(), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    await router.start()
    server.ready = ready
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server, router
    finally:
        await router.close()
        await runner.cleanup()


def pair(path):
    return {"small": str(path), "large": str(path)}


async def test_openai_client_chat_and_completions_match_single_model(tiny_chat_model):
    eng = Engine.from_pretrained(tiny_chat_model, num_kv_tokens=2048)
    msgs = [{"role": "user", "content": "Tell me a story about a cat."}]
    ids = eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    ref_chat = eng.generate(ids, max_tokens=20, temperature=0.0, ignore_eos=True)[0].text
    ref_cmpl = eng.generate("Once upon a time", max_tokens=20, temperature=0.0, ignore_eos=True)[0].text
    async with running_server(pair(tiny_chat_model), policy_args={"p": 0.4, "seed": 3}) as (url, _, router):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none")
        extra = {"ignore_eos": True}
        r = await client.chat.completions.create(model="aiorouter", messages=msgs, max_tokens=20, temperature=0,
                                                 extra_body=extra)
        assert r.choices[0].message.content == ref_chat
        assert r.usage.completion_tokens == 20
        per_model = r.model_extra.get("usage", {}) if r.model_extra else {}
        per_model = r.usage.model_extra["per_model"]
        assert sum(per_model.values()) == 20 and per_model["large"] > 0
        stream = await client.chat.completions.create(model="aiorouter", messages=msgs, max_tokens=20, temperature=0,
                                                      stream=True, stream_options={"include_usage": True},
                                                      extra_body=extra)
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        assert text == ref_chat and usage.completion_tokens == 20
        c = await client.completions.create(model="aiorouter", prompt="Once upon a time", max_tokens=20,
                                            temperature=0, extra_body=extra)
        assert c.choices[0].text == ref_cmpl and c.choices[0].finish_reason == "length"
        s = await client.completions.create(model="aiorouter", prompt="Once upon a time", max_tokens=20,
                                            temperature=0, stream=True, extra_body=extra)
        assert "".join([ch.choices[0].text async for ch in s]) == ref_cmpl
        models = await client.models.list()
        assert models.data[0].id == "aiorouter"


async def kv_used(url, headers=None):
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics", headers=headers) as r:
            text = await r.text()
    used = {}
    for line in text.splitlines():
        if line.startswith("aiorouter_kv_pages_used{"):
            used[line.split('model="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return used, text


async def test_64_concurrent_streams_then_kv_back_to_idle(tiny_chat_model):
    async with running_server(pair(tiny_chat_model)) as (url, server, router):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        idle, _ = await kv_used(url)

        async def one(i):
            s = await client.completions.create(model="aiorouter", prompt=f"Number {i}:", max_tokens=8,
                                                temperature=0.7, seed=i, stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in s])

        outs = await asyncio.gather(*(one(i) for i in range(64)))
        assert len(outs) == 64 and all(isinstance(o, str) for o in outs)
        await asyncio.sleep(0.05)
        used, text = await kv_used(url)
        assert used == idle == {"small": 0.0, "large": 0.0}
        assert 'aiorouter_tokens_total{model="small"}' in text and "aiorouter_requests_total" in text
        assert router.metrics.requests_finished["length"] == 64


BAD = [
    ("malformed json", {"data": b"{not json", "headers": {"Content-Type": "application/json"}}, 400),
    ("wrong content type", {"data": b"prompt=hi", "headers": {"Content-Type": "text/plain"}}, 415),
    ("missing prompt", {"json": {"model": "aiorouter"}}, 400),
    ("wrong type", {"json": {"prompt": "hi", "max_tokens": "ten"}}, 400),
    ("negative max_tokens", {"json": {"prompt": "hi", "max_tokens": -5}}, 400),
    ("huge max_tokens", {"json": {"prompt": "hi", "max_tokens": 10**9}}, 400),
    ("prompt too long", {"json": {"prompt": "hello " * 3000}}, 400),
    ("repetition_penalty out of range", {"json": {"prompt": "hi", "repetition_penalty": 0}}, 400),
    ("n past the bound", {"json": {"prompt": "hi", "n": 129}}, 400),
    ("best_of below n", {"json": {"prompt": "hi", "n": 3, "best_of": 2}}, 400),
    ("best_of streamed", {"json": {"prompt": "hi", "n": 1, "best_of": 2, "stream": True}}, 400),
    ("an empty prompt in a batch", {"json": {"prompt": ["hi", ""]}}, 400),
    ("penalty out of range", {"json": {"prompt": "hi", "presence_penalty": 2.5}}, 400),
    ("logit_bias out of range", {"json": {"prompt": "hi", "logit_bias": {"5": 101}}}, 400),
    ("logit_bias past the vocabulary", {"json": {"prompt": "hi", "logit_bias": {"99999999": 1}}}, 400),
    ("stop_token_ids past the vocabulary", {"json": {"prompt": "hi", "stop_token_ids": [99999999]}}, 400),
    ("min_tokens past max_tokens", {"json": {"prompt": "hi", "max_tokens": 3, "min_tokens": 4}}, 400),
    ("body too large", {"data": b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}',
                        "headers": {"Content-Type": "application/json"}}, 413),
    ("non utf-8", {"data": b'{"prompt": "\xff\xfe"}', "headers": {"Content-Type": "application/json"}}, 400),
    ("bad temperature", {"json": {"prompt": "hi", "temperature": -1}}, 400),
    ("unknown model", {"json": {"prompt": "hi", "model": "gpt-9"}}, 404),
    ("token id out of vocab", {"json": {"prompt": [1, 2, 10**7]}}, 400),
    ("bad routing override", {"json": {"prompt": "hi", "routing": {"policy": "nope"}}}, 400),
    ("bad routing arg", {"json": {"prompt": "hi", "routing": {"policy": "rstitch", "zeta": 1}}}, 400),
    # issue 44's probe: each of these once killed a subserver, got a 500, or a Python error as its message
    ("seed past 64 bits", {"json": {"prompt": "x", "max_tokens": 2, "seed": 1180591620717411303424}}, 400),
    ("routing arg of the wrong type", {"json": {"prompt": "hi", "routing": {"policy": "rstitch", "tau": "high"}}},
     400),
    ("100,000 nested arrays", {"data": b"[" * 100_000 + b"]" * 100_000,
                               "headers": {"Content-Type": "application/json"}}, 400),
    ("an integer of 5,000 digits", {"data": b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
                                    "headers": {"Content-Type": "application/json"}}, 400),
    ("per-request trained router", {"json": {"prompt": "hi", "routing": {"policy": "r2r",
                                                                          "router": "/nonexistent/r.pt"}}}, 400),
    ("wrong type deep inside", {"json": {"prompt": "hi", "routing": {"policy": "rstitch", "tau": [[{"a": 1}]]}}},
     400),
    ("nan routing arg", {"data": b'{"prompt": "hi", "routing": {"policy": "rstitch", "tau": NaN}}',
                         "headers": {"Content-Type": "application/json"}}, 400),
]

# the message each of issue 44's probes gets: the field and what it takes, in our words
BAD_SAYS = {
    "seed past 64 bits": "seed: must be an integer in [-9223372036854775808, 9223372036854775807]",
    "routing arg of the wrong type": "routing.tau: ",
    "100,000 nested arrays": "request body nests too deeply to parse",
    "an integer of 5,000 digits": "request body holds a number too large to read",
    "per-request trained router": "routing: policy 'r2r' cannot be chosen per request",
    "repetition_penalty out of range": "repetition_penalty: Input should be greater than 0",
    "penalty out of range": "presence_penalty: Input should be less than or equal to 2",
    "logit_bias out of range": "logit_bias: the bias of token 5 is 101.0; biases are in [-100, 100]",
    "logit_bias past the vocabulary": "logit_bias: token id 99999999 is outside the vocabulary [0, 49152)",
    "stop_token_ids past the vocabulary": "stop_token_ids: token id 99999999 is outside the vocabulary [0, 49152)",
    "min_tokens past max_tokens": "min_tokens=4 exceeds max_tokens=3",
    "best_of below n": "best_of must be at least n (3), got 2",
    "best_of streamed": "best_of larger than n cannot stream",
    "an empty prompt in a batch": "prompt: a prompt of the batch is empty",
}


async def test_bad_inputs_get_4xx_and_server_keeps_serving(tiny_chat_model):
    async with running_server(pair(tiny_chat_model)) as (url, server, router):
        async with aiohttp.ClientSession() as s:
            for name, kw, status in BAD:
                async with s.post(url + "/v1/completions", **kw) as r:
                    assert r.status == status, (name, r.status, await r.text())
                    body = await r.json()
                    assert body["error"]["message"] and body["error"]["type"], name
                    assert "Value error" not in body["error"]["message"], body  # our words, not pydantic's
                    assert BAD_SAYS.get(name, "") in body["error"]["message"], (name, body)
                    assert "not supported between" not in body["error"]["message"], body  # not a Python error
            async with s.post(url + "/v1/completions", json={"prompt": "hi", "n": 129}) as r:
                assert (await r.json())["error"]["message"] == "n: Input should be less than or equal to 128"
            async with s.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "tools": [{}]}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "tools"
            # a field the server does not know is ignored, as vLLM does, and the answer says so (issue 40;
            # refused under --strict: tests/test_server_protocol.py)
            async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                             "frobnicate": 1}) as r:
                assert r.status == 200 and r.headers["X-Aiorouter-Ignored-Fields"] == "frobnicate"
            async with s.post(url + "/v1/chat/completions", json={"messages": []}) as r:
                assert r.status == 400
            ok = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True, "routing": {"policy": "rstitch", "tau": 0.05}}
            async with s.post(url + "/v1/completions", json=ok) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["usage"]["completion_tokens"] == 3
        assert router.num_active == 0


async def test_disconnects_abort_and_free_kv(tiny_chat_model):
    async with running_server(pair(tiny_chat_model)) as (url, server, router):
        async def disconnect_after_first_chunk(i):
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/completions", json={"prompt": f"go {i}", "max_tokens": 500,
                                                                 "stream": True, "ignore_eos": True}) as r:
                    assert r.status == 200
                    await r.content.readline()
            # leaving both contexts closes the connection mid-stream
        await asyncio.gather(*(disconnect_after_first_chunk(i) for i in range(20)))
        for _ in range(100):
            if router.num_active == 0 and server.in_flight == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)
        assert router.num_active == 0 and server.in_flight == 0
        assert router.metrics.requests_finished["abort"] == 20
        # A model frees an aborted request's pages when its subserver next reads its inbox, which
        # waits for a step in flight to end (seconds on a loaded 2-core machine): poll for that.
        for _ in range(200):
            used, _ = await kv_used(url)
            if used == {"small": 0.0, "large": 0.0}:
                break
            await asyncio.sleep(0.05)
        assert used == {"small": 0.0, "large": 0.0}


async def test_api_key_required(tiny_chat_model):
    async with running_server(pair(tiny_chat_model), api_key=KEY) as (url, server, router):
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                assert r.status == 200
            for path in ("/v1/models", "/metrics", "/version"):
                async with s.get(url + path) as r:
                    assert r.status == 401
                async with s.get(url + path, headers={"Authorization": "Bearer wrong"}) as r:
                    assert r.status == 401
            async with s.post(url + "/v1/completions", json={"prompt": "hi"}) as r:
                assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY)
        c = await client.completions.create(model="aiorouter", prompt="hi", max_tokens=2)
        assert c.choices[0].text is not None


async def test_backpressure_answers_429(tiny_chat_model):
    models = {"small": {"engine": "sim", "latency_ms": 20.0, "vocab_size": 49152},
              "large": {"engine": "sim", "latency_ms": 20.0, "vocab_size": 49152}}
    async with running_server(models, max_concurrency=2, max_queue=1) as (url, server, router):
        async with aiohttp.ClientSession() as s:
            async def one():
                async with s.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 20}) as r:
                    return r.status, r.headers.get("Retry-After")
            results = await asyncio.gather(*(one() for _ in range(6)))
        statuses = sorted(st for st, _ in results)
        assert statuses.count(200) == 3 and statuses.count(429) == 3, statuses
        assert all(ra == "1" for st, ra in results if st == 429)


def test_sigterm_finishes_in_flight_and_exits_0(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", "a=sim:30", "--model", "b=sim:30",
                             "--policy", "random", "--port", str(port), "--grace", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        url = f"http://127.0.0.1:{port}"

        async def scenario():
            await wait_healthy(url, timeout=20, interval=0.1)
            async with aiohttp.ClientSession() as s:
                req = asyncio.create_task(s.post(url + "/v1/completions",
                                                 json={"prompt": [5, 6, 7], "max_tokens": 30, "ignore_eos": True}))
                await asyncio.sleep(0.3)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                async with s.post(url + "/v1/completions", json={"prompt": [5], "max_tokens": 2}) as r:
                    assert r.status == 503  # draining: no new work
                r = await req
                body = await r.json()
                assert r.status == 200 and body["usage"]["completion_tokens"] == 30
        asyncio.run(scenario())
        assert proc.wait(timeout=30) == 0
        out = proc.stdout.read()
        assert "ready: http://127.0.0.1" in out and "model a:" in out and "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_generation_is_refused_with_503_until_the_models_are_ready(tiny_chat_model):
    async with running_server(pair(tiny_chat_model), ready=False) as (url, server, router):
        async with aiohttp.ClientSession() as s:
            chat = {"messages": [{"role": "user", "content": "hi"}]}
            async with s.post(url + "/v1/chat/completions", json=chat) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert "still loading" in (await r.json())["error"]["message"]


# -- sampling defaults: the model's generation_config.json, as vLLM ------------------------------------
def with_generation_config(src, dst, **fields):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**cfg, **fields}))
    return dst


def test_sampling_defaults_load(tmp_path):
    assert SamplingDefaults.load("neutral", tmp_path) == SamplingDefaults()
    assert SamplingDefaults.load("auto", tmp_path) == SamplingDefaults()  # no file: neutral
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 64,
         "eos_token_id": 2, "repetition_penalty": 1.1}))
    d = SamplingDefaults.load("auto", tmp_path)
    # repetition_penalty too, as vLLM reads it (a request's own value wins: test_sampling_controls.py)
    assert (d.temperature, d.top_p, d.top_k, d.min_p, d.max_tokens, d.repetition_penalty) == (0.6, 0.95, 20, 0.0, 64,
                                                                                              1.1)
    assert SamplingDefaults.load(str(tmp_path), None) == d  # a directory of its own
    assert SamplingDefaults.load("neutral", tmp_path) == SamplingDefaults()
    with pytest.raises(ValueError, match="no generation_config.json there"):
        SamplingDefaults.load(str(tmp_path / "nowhere"), None)
    for bad, words in (({"temperature": -1}, "temperature=-1.0"), ({"top_k": 1.5}, "top_k must be an integer"),
                       ({"top_p": "high"}, "top_p must be a number"), ({"max_new_tokens": 0}, "max_tokens=0"),
                       ({"repetition_penalty": 0}, "repetition_penalty=0.0")):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=words):
            SamplingDefaults.load("auto", tmp_path)


async def test_omitted_fields_take_the_generation_config(tiny_chat_model, tmp_path):
    # top_k=1 makes sampling at temperature 1 greedy: if the default were not applied, the tiny random
    # model (its next-token distribution near uniform over 49152 tokens) would not repeat the greedy text
    path = with_generation_config(tiny_chat_model, tmp_path / "m", temperature=1.0, top_k=1, max_new_tokens=7)
    greedy = Engine.from_pretrained(path, num_kv_tokens=2048).generate(
        "Once upon a time", max_tokens=7, temperature=0.0, ignore_eos=True)[0].text
    body = {"prompt": "Once upon a time", "ignore_eos": True, "seed": 11}
    async with running_server({"m": str(path)}, policy="single") as (url, server, router):
        async with aiohttp.ClientSession() as s:
            async def complete(**extra):
                async with s.post(url + "/v1/completions", json={**body, **extra}) as r:
                    assert r.status == 200, await r.text()
                    out = await r.json()
                    return out["choices"][0]["text"], out["usage"]["completion_tokens"]
            assert await complete() == (greedy, 7)  # top_k and max_tokens from the file
            sampled = await complete(top_k=0, max_tokens=7)  # the request's own value wins
            assert sampled[0] != greedy
    async with running_server({"m": str(path)}, policy="single", generation_config="neutral") as (url, _, _):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={**body, "max_tokens": 7}) as r:
                neutral = (await r.json())["choices"][0]["text"]
            async with s.post(url + "/v1/completions", json={**body, "max_tokens": 7, "temperature": 1.0,
                                                             "top_k": 0}) as r:
                explicit = (await r.json())["choices"][0]["text"]
    assert neutral == explicit == sampled[0]  # neutral: temperature 1, no top_k; same seed, same tokens
