"""The embedded default pair (engines.known_models.default_pair): SmolLM2-135M-Instruct loaded
int4 as the small model, the same checkpoint in fp32 as the large one. It must route for real at
temperature 0: the small model writes a real share of the answers, and the answers stay the
large model's (bench/default_pair.py measures the whole question set)."""
from __future__ import annotations

import asyncio
import json
import os

import pytest

from aiorouter import DEFAULT_POLICY, DEFAULT_POLICY_ARGS, Router, RouterConfig, default_models
from aiorouter.cpu_threads import plan_threads
from bench.default_pair import FACTUAL_QUESTIONS, correct
from engines import Engine
from engines.default_model import MARKER
from engines.known_models import default_pair
from engines.quant import CONFIG_KEY


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    return {name: Engine(path) for name, path in default_pair().items()}


def test_small_model_dir_shares_the_large_weights_and_asks_for_int4():
    pair = default_pair()
    small, large = pair["small"], pair["large"]
    assert (small / MARKER).is_file() and small != large
    assert json.loads((small / "config.json").read_text())[CONFIG_KEY] == "int4"
    link = small / "model.safetensors"
    assert link.is_symlink() and link.resolve() == (large / "model.safetensors").resolve()
    assert not os.path.isabs(os.readlink(link))  # relative: the cache folder may move whole
    assert default_pair() == pair  # built once, then found


def test_default_models_name_the_pair_through_the_public_spec():
    specs, pair = default_models(), default_pair()
    assert (specs["large"].path, specs["large"].quantization) == (str(pair["large"]), None)
    # the same weights loaded int4 (ModelSpec.quantization): what the small directory's config asks for
    assert (specs["small"].path, specs["small"].quantization) == (str(pair["large"]), "int4")


def test_small_engine_is_quantized_and_the_lighter_one(engines):
    small, large = engines["small"], engines["large"]
    c = small.model_config
    # every linear layer left the dense parameters (the embedding and norms remain), so the thread
    # planner (aiorouter.cpu_threads, by parameter count) gives the large model the cores
    assert small.num_params == c.vocab_size * c.hidden_size + c.num_hidden_layers * 2 * c.hidden_size + c.hidden_size
    assert plan_threads([large.num_params, small.num_params], cores=2) == [2, 1]


def test_default_pair_routes_and_answers_like_the_large_model(engines):
    questions = FACTUAL_QUESTIONS[:4]

    async def ask(models: dict, policy: str, args: dict):
        async with Router(models, RouterConfig(policy=policy, policy_args=args, entry=next(iter(models)),
                          thresholds={k: 1 for k in models})) as r:
            return await asyncio.gather(*(r.generate([{"role": "user", "content": q}], max_tokens=16, temperature=0.0)
                                          for q, _ in questions))

    # the policy and threshold bench/default_pair.py picked (bench/RESULTS.md, "The default pair")
    routed = asyncio.run(ask(engines, DEFAULT_POLICY, dict(DEFAULT_POLICY_ARGS)))
    alone = asyncio.run(ask({"large": engines["large"]}, "single", {}))
    small = sum(r.usage["per_model"]["small"] for r in routed)
    large = sum(r.usage["per_model"]["large"] for r in routed)
    assert small >= 0.4 * (small + large), (small, large)  # the former default wrote ~0 tokens here
    assert large > 0  # and it does hand uncertain tokens over
    assert sum(r.token_ids == a.token_ids for r, a in zip(routed, alone)) >= 3
    for r, a, (_, keywords) in zip(routed, alone, questions):
        assert correct(r.text, keywords) == correct(a.text, keywords), (r.text, a.text)
