"""One request never takes the router or the server down: bad input is refused at the edge, a
failure while serving fails its request alone, and a subserver that dies anyway (killed on purpose
here, standing for a bug) fails every request at once, answers unhealthy, and restarts with a fresh
engine state; past its restarts the router is dead and `aiorouter serve` exits with status 1.
Real tiny engines, and sim engines where a whole server process runs."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import aiohttp
import pytest
from test_router import kv_clean

from aiorouter import Router, RouterConfig, RouterError, RouterUnavailable
from aiorouter.faults import FaultPlan
from bench.common import free_port, wait_healthy
from engines import Engine

KILL = (501, 502, 509)
PLAN = FaultPlan({"kill": KILL}, after=2)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def failures(router, prompts, max_tokens):
    """Run the prompts together -> per prompt (the exception or the tokens, when it ended)."""
    async def one(p):
        try:
            out = (await router.generate(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)).token_ids
        except RouterError as e:
            out = e
        return out, time.monotonic()
    return await asyncio.gather(*(one(p) for p in prompts))


async def test_a_killed_subserver_fails_every_request_at_once_then_restarts_fresh(tiny_qwen3):
    ref = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=2048).generate(
        [[5, 6, 7, 8]], max_tokens=12, temperature=0.0, ignore_eos=True)[0].token_ids
    async with Router({"small": str(tiny_qwen3), "large": str(tiny_qwen3)}, RouterConfig(policy="random",
                      policy_args={"p": 0.5, "seed": 2}, mode="eager", faults=PLAN, kv_memory_gb=0.05,
                      restart_delay_s=0.5)) as r:
        prompts = [[20 + i, 30 + i, 40 + i] for i in range(5)] + [list(KILL) + [7, 8]]
        got = await failures(r, prompts, max_tokens=400)  # far longer than the kill takes to fire
        errors = [out for out, _ in got]
        assert all(isinstance(e, RouterUnavailable) for e in errors), errors
        died = next(n for n in r.names if f"the subserver of model {n!r} died: SubserverKilled" in str(errors[0]))
        assert all("every request in flight failed" in str(e) for e in errors)
        ends = [t for _, t in got]
        assert max(ends) - min(ends) < 1.0  # all at once, not each as it would have ended
        # down until the restart: health names the model, submit refuses with the reason
        assert set(r.health()) == {died} and "restarting it in 0.5 s" in r.health()[died]
        with pytest.raises(RouterUnavailable, match=f"model {died!r} died"):
            r.submit([5, 6], max_tokens=2)
        for _ in range(100):
            if not r.health():
                break
            await asyncio.sleep(0.02)
        assert r.health() == {} and r.dead is None and r.metrics.subserver_restarts[died] == 1
        assert r.num_tasks == 2 and not r.dead_tasks()
        # the fresh engine state serves exactly: greedy through both models equals one model alone
        assert (await r.generate([5, 6, 7, 8], max_tokens=12, temperature=0.0, ignore_eos=True)).token_ids == ref
        await asyncio.sleep(0.05)
        kv_clean(r)


async def test_past_max_restarts_the_router_is_dead_and_says_why(tiny_qwen3):
    async with Router({"small": str(tiny_qwen3), "large": str(tiny_qwen3)}, RouterConfig(policy="single", faults=PLAN,
                      kv_memory_gb=0.05, max_restarts=0)) as r:
        (err, _), = await failures(r, [list(KILL) + [7]], max_tokens=50)
        assert isinstance(err, RouterUnavailable)
        why = await asyncio.wait_for(r.wait_dead(), 1.0)
        assert "model 'small' died" in why and "max_restarts=0" in why and r.dead == why
        assert r.health() == {"small": why}
        with pytest.raises(RouterUnavailable, match="max_restarts=0"):
            r.submit([5, 6], max_tokens=2)
    with pytest.raises(ValueError, match="max_restarts must be an integer >= 0"):
        Router({"small": str(tiny_qwen3)}, RouterConfig(max_restarts=-1))


class OneBadToken:
    """The model's real tokenizer, except that decoding `bad` raises: a tokenizer (a user's own, or
    one out of step with its model) that fails on one token id."""

    def __init__(self, tokenizer, bad: int):
        self.tok, self.bad = tokenizer, bad

    def decode(self, ids, **kw):
        if self.bad in ids:
            raise KeyError(f"no piece for token {self.bad}")
        return self.tok.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


async def test_a_token_that_will_not_detokenize_fails_its_request_alone(tiny_chat_model):
    plain = Engine.from_pretrained(tiny_chat_model, num_kv_tokens=2048)
    prompts = [[1000 + 7 * i, 2000 + 5 * i, 3000 + i] for i in range(4)]
    ref = [o.token_ids for o in plain.generate(prompts, max_tokens=8, temperature=0.0, ignore_eos=True)]
    bad = next(t for t in ref[1][2:] if all(t not in ref[i] for i in (0, 2, 3)))  # only request 1 makes it
    engines = {}
    for name in ("small", "large"):
        e = Engine.from_pretrained(tiny_chat_model, num_kv_tokens=2048)
        e.tokenizer = OneBadToken(e.tokenizer, bad)
        engines[name] = e
    async with Router(engines, RouterConfig(policy="random", policy_args={"p": 0.3, "seed": 1}, mode="eager")) as r:
        got = [out for out, _ in await failures(r, prompts, max_tokens=8)]
        assert isinstance(got[1], RouterError) and f"(id {bad}) from model" in str(got[1])
        assert "KeyError" in str(got[1]) and not isinstance(got[1], RouterUnavailable)
        assert [got[i] for i in (0, 2, 3)] == [ref[i] for i in (0, 2, 3)]
        assert r.health() == {} and r.num_tasks == 2 and not r.dead_tasks()
        await asyncio.sleep(0.05)
        kv_clean(r)


async def test_a_seed_past_64_bits_is_refused_and_the_router_serves_on(tiny_qwen3):
    async with Router({"m": str(tiny_qwen3)}, RouterConfig(kv_memory_gb=0.05)) as r:
        for seed in (2**70, -(2**63) - 1, 1.5, True):
            with pytest.raises(ValueError, match=r"seed must be an integer in \[-9223372036854775808, "
                                                 r"9223372036854775807\]"):
                await r.generate([5, 6], max_tokens=2, seed=seed)
        for seed in (2**63 - 1, -(2**63)):  # the ends of the range sample
            out = await r.generate([5, 6], max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True)
            again = await r.generate([5, 6], max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True)
            assert out.token_ids == again.token_ids and len(out.token_ids) == 3
        assert r.health() == {} and not r.dead_tasks()


# -- a whole server process: /health, in-flight failures, the documented recovery ------------------
async def poll(s, url, until, timeout):
    """GET /health every 20 ms until `until(status, body)` -> (seconds it took, status, body)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            async with s.get(url + "/health") as r:
                status, body = r.status, await r.text()
        except aiohttp.ClientError:
            status, body = None, ""
        if until(status, body):
            return time.monotonic() - t0, status, body
        await asyncio.sleep(0.02)
    raise AssertionError(f"/health did not reach the state in {timeout} s: last {status} {body}")


async def stream_until_error(s, url, prompt):
    """A streamed completion that runs long -> (its error event, when it came)."""
    body = {"prompt": prompt, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {") and b'"error"' in line:
                return json.loads(line[6:])["error"], time.monotonic()
    raise AssertionError("the stream ended without an error event")


def test_serve_restarts_a_killed_subserver_then_exits_1_past_max_restarts(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(FaultPlan({"kill": KILL}, after=2).to_json())
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", "small=sim:5", "--model",
                             "large=sim:5", "--policy", "random", "--port", str(port), "--inject-faults", str(plan),
                             "--max-restarts", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    url = f"http://127.0.0.1:{port}"

    async def kill_with_streams_in_flight(s):
        streams = [asyncio.create_task(stream_until_error(s, url, [20 + i, 30 + i])) for i in range(4)]
        await asyncio.sleep(0.3)  # the streams are decoding
        t_kill = time.monotonic()
        async with s.post(url + "/v1/completions", json={"prompt": list(KILL) + [7], "max_tokens": 50}) as r:
            killed = r.status, (await r.json())["error"]
        health = asyncio.create_task(poll(s, url, lambda st, _: st != 200, timeout=5))
        errors = await asyncio.gather(*streams)
        return t_kill, killed, errors, await health

    async def scenario():
        await wait_healthy(url, timeout=30, interval=0.1)
        async with aiohttp.ClientSession() as s:
            t_kill, (status, err), errors, (dt, hstatus, hbody) = await kill_with_streams_in_flight(s)
            assert status == 503 and "died: SubserverKilled" in err["message"] and err["type"] == "unavailable"
            assert hstatus == 503 and dt < 1.0 and "is down: the subserver of model" in hbody, (dt, hstatus, hbody)
            assert "restarting it in 0.5 s" in hbody
            for e, t in errors:  # every stream in flight ends with the reason, within a second
                assert e["code"] == 503 and "every request in flight failed" in e["message"] and t - t_kill < 1.0
            await poll(s, url, lambda st, _: st == 200, timeout=5)  # restarted
            async with s.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 6,
                                                             "ignore_eos": True}) as r:
                assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 6
            metrics = await (await s.get(url + "/metrics")).text()
            assert sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                       if line.startswith("aiorouter_subserver_restarts_total{")) == 1
            # past --max-restarts 1: down for good; /health says so (or the port is already closed)
            t_kill, (status, err), errors, (dt, hstatus, hbody) = await kill_with_streams_in_flight(s)
            assert status == 503 and "so it stays down" in err["message"] and dt < 1.0
            assert hstatus in (503, None) and (hstatus is None or "stays down" in hbody)
            assert all(e["code"] == 503 and t - t_kill < 1.0 for e, t in errors)

    try:
        asyncio.run(scenario())
        assert proc.wait(timeout=30) == 1
        out = proc.stdout.read()
        assert "subserver restarted with a fresh engine state" in out
        assert "exiting with status 1 so that a supervisor restarts the server" in out
    finally:
        if proc.poll() is None:
            proc.kill()
