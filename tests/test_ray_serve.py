"""aiorouter on Ray Serve: resources from model specs, the missing-extra message, and 2 replicas on a
local 127.0.0.1 Ray cluster driven by the openai client (marked `ray` and `slow`: see README)."""
from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time

import aiohttp
import openai
import pytest

from aiorouter import RouterConfig
from bench.common import free_port
from server.app import ServerConfig
from server.ray_serve import REPLICA_HEADER, replica_resources
from test_server import pair, running_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_replica_resources_follow_the_model_specs():
    opts, specs, device = replica_resources({"a": "/m/a", "b": {"path": "/m/b", "dtype": "bfloat16"}})
    assert opts == {"num_cpus": 2.0} and device == "cpu"  # a core per CPU model
    assert specs["a"].device == specs["b"].device == "cpu" and specs["b"].dtype == "bfloat16"
    opts, _, _ = replica_resources({"a": "/m/a", "b": {"engine": "sim"}})  # a simulated model only sleeps
    assert opts == {"num_cpus": 1.0}
    # Ray shows a replica its GPUs as cuda:0..k-1: cuda:2 and cuda:3 become 0 and 1, in place
    opts, specs, device = replica_resources({"a": {"path": "/m/a", "device": "cuda:3"},
                                             "b": {"path": "/m/b", "device": "cuda:2,3"}}, device="cuda:2")
    assert opts == {"num_cpus": 1.0, "num_gpus": 2.0} and device == "cuda:0"
    assert specs["a"].device == "cuda:1" and specs["b"].device == "cuda:0,1"
    opts, specs, _ = replica_resources({"a": "/m/a", "b": "/m/b"}, device="cuda", num_cpus=0.25)
    assert opts == {"num_cpus": 0.25, "num_gpus": 1.0} and specs["b"].device == "cuda:0"


def test_nothing_else_imports_ray_and_serve_ray_names_the_extra():
    code = ("import sys; sys.modules['ray'] = None\n"  # as if the extra were not installed
            "import aiorouter, engines, policies, server.app, server.cli, server.ray_serve\n"
            "from server.cli import main; sys.exit(main(['serve', '--ray', '--model', 'a=sim:5']))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "pip install 'aiorouter[ray]'" in p.stderr, p.stderr
    code = ("import sys, aiorouter, engines, policies, server.app, server.cli, server.ray_serve\n"
            "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--replicas", "2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "need --ray" in p.stderr


# -- 2 replicas on Ray Serve ---------------------------------------------------------------------------
ROUTER = {"policy": "random", "policy_args": {"p": 0.4, "seed": 3}, "kv_memory_gb": 0.05}
# two running and one waiting inside each replica; the rest wait in Serve's queue at the ingress
CONFIG = ServerConfig(max_concurrency=2)
PROMPTS = [f"Request {i}: tell me about the number {i}." for i in range(16)]
LONG = 400  # tokens per stream in the kill phase: long enough to be mid-stream when the replica dies


@pytest.fixture
def ray_app(tiny_chat_model):
    from server.ray_serve import APP, build_app, require_ray
    if importlib.util.find_spec("ray") is None:
        pytest.fail("the ray tests need the ray extra: pip install -e '.[test,ray]'")
    ray, serve = require_ray(loopback=True)  # ray is first imported here: no other test module imports it
    port = free_port()
    t0 = time.perf_counter()
    # workers import aiorouter from this checkout, as the test process does
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    try:
        assert "node:127.0.0.1" in ray.cluster_resources(), ray.cluster_resources()  # loopback only
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(pair(tiny_chat_model), RouterConfig(**ROUTER), CONFIG, replicas=2, num_cpus=0.5,
                        max_ongoing_requests=3)
        serve.run(app, name=APP, route_prefix="/")
        print(f"ray + 2 replicas up in {time.perf_counter() - t0:.1f}s")
        yield f"http://127.0.0.1:{port}", ray
    finally:
        serve.shutdown()
        ray.shutdown()


async def _answer(client: openai.AsyncOpenAI, i: int, prompt: str, max_tokens: int = 16) -> tuple[str, str]:
    """Request i's text, by one of four shapes (chat/completion, streamed or not), and its replica."""
    kw = dict(model="aiorouter", max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    chat, stream = i % 2 == 0, i % 4 < 2
    if chat:
        call = client.chat.completions.with_raw_response.create(messages=[{"role": "user", "content": prompt}],
                                                                stream=stream, **kw)
    else:
        call = client.completions.with_raw_response.create(prompt=prompt, stream=stream, **kw)
    raw = await call
    r = raw.parse()  # with_raw_response is the legacy wrapper: parse() is not awaited
    if stream:
        text = "".join([(c.choices[0].delta.content or "") if chat else c.choices[0].text async for c in r])
    else:
        text = r.choices[0].message.content if chat else r.choices[0].text
    return text, raw.headers.get(REPLICA_HEADER, "")


async def _replica_metrics(url: str) -> dict[str, float]:
    """Finished requests per replica, read from each replica's own /metrics."""
    seen: dict[str, float] = {}
    async with aiohttp.ClientSession() as s:
        for _ in range(200):  # each scrape lands on one replica; the header says which
            async with s.get(url + "/metrics") as r:
                assert r.status == 200
                text = await r.text()
                seen[r.headers[REPLICA_HEADER]] = sum(
                    float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("aiorouter_requests_total{"))
            if len(seen) == 2:
                break
    return seen


@pytest.mark.ray
@pytest.mark.slow
async def test_two_replicas_match_one_process_and_survive_a_replica_kill(ray_app, tiny_chat_model):
    url, ray = ray_app
    t0 = time.perf_counter()
    # the single-process server's answers, the same router, the same four request shapes
    # (running_server builds its router with the same kv_memory_gb)
    async with running_server(pair(tiny_chat_model), ROUTER["policy"], ROUTER["policy_args"]) as (ref_url, _, _):
        ref = openai.AsyncOpenAI(base_url=ref_url + "/v1", api_key="none", max_retries=0)
        want = [(await _answer(ref, i, p))[0] for i, p in enumerate(PROMPTS)]
        want_long = [(await _answer(ref, 1, f"Story {i}:", LONG))[0] for i in range(8)]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    gate = asyncio.Semaphore(8)

    async def bounded(i: int, p: str) -> tuple[str, str]:
        async with gate:
            return await _answer(client, i, p)

    got = await asyncio.gather(*(bounded(i, p) for i, p in enumerate(PROMPTS)))
    assert [text for text, _ in got] == want
    per_replica = await _replica_metrics(url)
    assert len(per_replica) == 2 and all(n > 0 for n in per_replica.values()), per_replica
    assert sum(per_replica.values()) == len(PROMPTS)
    assert {rep for _, rep in got} == set(per_replica)
    print(f"parity + metrics phase {time.perf_counter() - t0:.1f}s; requests per replica {per_replica}")

    # kill one replica while 2 streams run on each, 1 waits inside each and 2 wait in Serve's queue
    chunks = [0] * 8
    replica_of: list[str | None] = [None] * 8

    async def long_stream(i: int) -> str:
        raw = await client.completions.with_raw_response.create(
            model="aiorouter", prompt=f"Story {i}:", max_tokens=LONG, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        replica_of[i] = raw.headers[REPLICA_HEADER]
        text = ""
        async for c in raw.parse():
            text += c.choices[0].text
            chunks[i] += 1
        return text

    tasks = [asyncio.create_task(long_stream(i)) for i in range(8)]
    for _ in range(600):
        if sum(c >= 5 for c in chunks) >= 4:
            break
        await asyncio.sleep(0.01)
    started = {i for i in range(8) if chunks[i]}
    victim = replica_of[min(started)]
    on_victim = {i for i in started if replica_of[i] == victim}
    assert len(started) == 4 and len(on_victim) == 2, (started, replica_of, chunks)
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    outs = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 150)
    for i, out in enumerate(outs):
        if i in on_victim:  # it was streaming on the dead replica: a clear error, not a hang
            assert isinstance(out, openai.APIError) and "died mid-stream" in str(out), (i, out)
        else:  # it had not started, or it ran on the survivor: a full, correct answer
            assert out == want_long[i], (i, out if isinstance(out, Exception) else out[:80])
    assert {replica_of[i] for i in set(range(8)) - started} - {victim}, "nothing was re-sent elsewhere"
    print(f"whole test {time.perf_counter() - t0:.1f}s; resent to {set(replica_of) - {victim}}")


@pytest.mark.ray
@pytest.mark.slow
def test_cli_serve_ray_two_replicas_backpressure_then_sigterm():
    if importlib.util.find_spec("ray") is None:
        pytest.fail("the ray tests need the ray extra: pip install -e '.[test,ray]'")
    port = free_port()
    # 2 running per replica and 2 x 2 waiting in Serve's queue: a burst of 16 overflows it
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--ray", "--replicas", "2", "--model",
                             "a=sim:5", "--model", "b=sim:5", "--policy", "random", "--port", str(port),
                             "--max-concurrency", "2", "--max-queue", "2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"

    async def scenario() -> list[tuple[int, str | None]]:
        async with aiohttp.ClientSession() as s:
            async def one(i: int) -> tuple[int, str | None]:
                async with s.post(url + "/v1/completions", json={"prompt": [5, i], "max_tokens": 20,
                                                                  "ignore_eos": True}) as r:
                    body = await r.json()
                    if r.status == 200:
                        assert body["usage"]["completion_tokens"] == 20
                        return 200, r.headers[REPLICA_HEADER]
                    assert r.status == 429 and body["error"]["type"] == "rate_limit_error", (r.status, body)
                    return 429, r.headers.get("Retry-After")
            return await asyncio.gather(*(one(i) for i in range(16)))
    try:
        deadline = time.monotonic() + 120
        while not any("ready: http://127.0.0.1" in line for line in lines):  # logged once both replicas are up
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        assert any("2 replicas on Ray Serve" in line for line in lines)
        results = asyncio.run(scenario())
        print(f"burst of 16: {sorted(st for st, _ in results)}")
        assert len({rep for st, rep in results if st == 200}) == 2, results  # the balancer used both replicas
        assert [ra for st, ra in results if st == 429] and all(ra == "1" for st, ra in results if st == 429)
        assert len([st for st, _ in results if st == 200]) >= 4, results  # the 4 slots at least
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        time.sleep(0.5)  # the reader thread takes the last lines
        assert "stopped" in lines[-1], "".join(lines[-5:])
    finally:
        if proc.poll() is None:  # SIGTERM first: the CLI shuts its local Ray cluster down
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
