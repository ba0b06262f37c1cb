"""Fuzzing driven by well-kept libraries: Schemathesis generates requests for every endpoint of a
real `aiorouter serve` process from the OpenAPI document the server publishes (valid bodies, and
bodies that break the schema at any depth), and hypothesis generates `Router.generate`'s
arguments. Any 5xx, hang past the timeout, or answer that breaks the document fails; afterwards
the server must still be healthy with no KV page held."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from aiorouter import Router, RouterConfig
from bench.common import free_port, wait_healthy
from conftest import make_tiny_chat_model

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
CASE_TIMEOUT_S = 20.0  # a hang: no answer this long (the longest valid request here ends within ~1 s)


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2):
    """`aiorouter serve` on a pair of tiny chat models with a 64-token context (so a valid request
    asking for every token still ends within a second: the fuzzer looks for failures, and a long
    answer finds no more of them than a short one), at most 4 choices a request (n, best_of, a
    batch of prompts: each choice is such an answer) and an API key (so auth is fuzzed too)."""
    model = make_tiny_chat_model(tmp_path_factory.mktemp("fuzz_model"), smollm2, max_positions=64)
    port = free_port()
    log = open(tmp_path_factory.mktemp("fuzz_log") / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", f"small={model}", "--model",
                             f"large={model}", "--policy", "random", "--kv-memory-gb", "0.05", "--port", str(port),
                             "--api-key", KEY, "--max-choices", "4"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_healthy(url, timeout=120, interval=0.1))
        yield url, proc, log
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def fuzz(url: str, examples_per_mode: int) -> Counter:
    """Every operation of the published document, `examples_per_mode` positive and as many negative
    cases each -> (operation, status) counts. Raises on the first failed check."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    seen: Counter = Counter()
    ops = [r.ok() for r in schema.get_all_operations()]
    # every endpoint but the document itself, which Schemathesis reads rather than fuzzes
    assert {op.label for op in ops} == {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
                                        "GET /health", "GET /metrics", "POST /reset_prefix_cache", "POST /tokenize",
                                        "POST /detokenize", "GET /version"}
    for op in ops:
        # a GET without parameters has nothing a negative case could break
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[:2 if len(op.body) else 1]:
            @settings(max_examples=examples_per_mode, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def one(case):
                # A schema-valid body may still be refused for what the document cannot say (a prompt
                # past the context, a token id past the vocabulary): positive acceptance is not asked.
                # Every other check is: no 5xx, documented status codes, content types and bodies,
                # schema-breaking bodies refused with a 4xx, and the API key enforced.
                resp = case.call_and_validate(base_url=url, headers=AUTH, timeout=CASE_TIMEOUT_S,
                                              excluded_checks=[positive_data_acceptance])
                seen[(op.label, resp.status_code)] += 1
            one()
    return seen


def after_fuzz_the_server_serves(url: str, proc: subprocess.Popen) -> None:
    assert proc.poll() is None, "the server process died"
    assert requests.get(url + "/health", timeout=5).status_code == 200
    r = requests.post(url + "/v1/completions", headers=AUTH, timeout=30,
                      json={"prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    metrics = requests.get(url + "/metrics", headers=AUTH, timeout=5).text
    used = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("aiorouter_kv_pages_used{")]
    assert used == [0.0, 0.0], used  # nothing leaked by a refused, failed or finished request
    assert "\naiorouter_requests_active 0.0\n" in metrics  # every request ended in the router


def report(seen: Counter, seconds: float) -> str:
    by_status, by_op = Counter(), Counter()
    for (op, status), n in seen.items():
        by_status[status] += n
        by_op[op] += n
    return (f"{sum(seen.values())} requests in {seconds:.0f} s; by operation {dict(by_op)}; "
            f"by status {dict(sorted(by_status.items()))}")


def test_schemathesis_fuzzes_every_endpoint_without_a_5xx_or_hang(served):
    url, proc, log = served
    t0 = time.monotonic()
    seen = fuzz(url, examples_per_mode=int(os.environ.get("AIOROUTER_FUZZ_EXAMPLES", "60")))
    print(report(seen, time.monotonic() - t0))
    assert sum(seen.values()) >= 300 and not any(status >= 500 for _, status in seen)
    # the generator reached the generating paths, not only their validation
    assert seen[("POST /v1/completions", 200)] > 0 and seen[("POST /v1/chat/completions", 200)] > 0
    assert seen[("POST /tokenize", 200)] > 0 and seen[("POST /detokenize", 200)] > 0
    assert sum(n for (op, status), n in seen.items() if 400 <= status < 500 and op.startswith("POST /v1")) > 0
    after_fuzz_the_server_serves(url, proc)


@pytest.mark.slow
def test_schemathesis_long_run(served):
    url, proc, log = served
    t0 = time.monotonic()
    seen = fuzz(url, examples_per_mode=int(os.environ.get("AIOROUTER_FUZZ_EXAMPLES_LONG", "400")))
    print(report(seen, time.monotonic() - t0))
    assert not any(status >= 500 for _, status in seen)
    after_fuzz_the_server_serves(url, proc)


# -- the library call: hypothesis drives Router.generate's arguments ------------------------------------
JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                   max_size=3), max_leaves=6)
EDGES = st.sampled_from([0, -1, 2**63, -(2**63) - 1, 10**30, 5e-324, 1e-45, 1e308, float("nan"), float("inf"),
                         -0.0, True, "1", [1], {}])
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                           "content": st.text(max_size=20)}), min_size=1, max_size=3)
PROMPTS = st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 49151), min_size=1, max_size=12),
                    MESSAGES, st.lists(st.integers(-5, 60_000), max_size=12),
                    st.lists(st.dictionaries(st.sampled_from(["role", "content", "x"]), JSONISH, max_size=3),
                             max_size=2), JSONISH)
VALID = st.fixed_dictionaries({"max_tokens": st.integers(1, 12)}, optional={  # short answers: many cases
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, 100), "min_p": st.floats(0, 1), "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3), "ignore_eos": st.booleans()})
# a valid call, or one with one argument (or an unknown one) replaced by an edge value or any JSON-ish value
ARGS = st.tuples(PROMPTS, VALID, st.none() | st.tuples(st.sampled_from([
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos", "nonsense"]),
    EDGES | JSONISH))


async def test_hypothesis_fuzzes_router_generate(tiny_chat_model):
    """Whatever arguments a caller passes, `generate` answers or raises ValueError/TypeError naming
    the problem, within a timeout, and the router serves the next request."""
    results: Counter = Counter()
    async with Router({"small": str(tiny_chat_model), "large": str(tiny_chat_model)}, RouterConfig(policy="random",
                      kv_memory_gb=0.05)) as router:
        loop = asyncio.get_running_loop()

        @settings(max_examples=int(os.environ.get("AIOROUTER_FUZZ_EXAMPLES_ROUTER", "150")), deadline=None,
                  database=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(args=ARGS)
        def one(args):
            prompt, kw, bad = args
            kw = {**kw, **dict([bad])} if bad else kw

            async def call():
                try:
                    out = await asyncio.wait_for(router.generate(prompt, **kw), timeout=CASE_TIMEOUT_S)
                except (ValueError, TypeError) as e:
                    assert str(e), (prompt, kw)  # a message that says something
                    results[type(e).__name__] += 1
                else:
                    assert isinstance(out.text, str) and out.finish_reason in ("stop", "length")
                    assert 1 <= len(out.token_ids) <= kw["max_tokens"]
                    results["answered"] += 1
            # hypothesis drives a plain function: each call runs on the router's loop, waited for here
            asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=CASE_TIMEOUT_S + 5)

        await loop.run_in_executor(None, one)
        assert router.health() == {} and router.num_active == 0
        assert router.kv_usage()["small"].pages_used == router.kv_usage()["large"].pages_used == 0
        out = await router.generate("Once upon a time", max_tokens=5, ignore_eos=True)
        assert len(out.token_ids) == 5
    print(dict(results))
    assert results["answered"] > 0 and results["ValueError"] + results["TypeError"] > 0, results
