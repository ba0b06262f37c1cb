"""Structured output (issue 40, item 5): JSON schema, JSON object, regex, choice and EBNF grammar
through xgrammar. The grammar's state is the request's: it advances with every committed token,
whichever model wrote it, and the model that samples masks its logits with it. Tiny random models
write garbage; constrained, they must still write what the grammar allows."""
from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest
import torch

from aiorouter import Router, RouterConfig, RouterError, RouterRequestError
from conftest import make_tiny_qwen3
from engines import Engine
from engines.grammar import Grammars, StructuredOutput, apply_grammar
from engines.sampling import SamplingParams, sample, sample_batched
from test_server import running_server

# bounded on purpose: a random model fills every free choice, so each string, number and list has
# a limit and the response must end well inside max_tokens
SCHEMA = {
    "type": "object",
    "properties": {
        # a pattern, not maxLength: xgrammar 0.2.9 compiles a maxLength string to characters other
        # than '"', '\\', CR and LF, so a raw control character (invalid JSON) can get in
        "name": {"type": "string", "pattern": "^[A-Za-z0-9 ]{0,6}$"},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "color", "count", "ok", "tags"],
    "additionalProperties": False,
}
MAX_TOKENS = 120  # the schema's longest answer is under 60 tokens of this vocabulary


@pytest.fixture(scope="module")
def second_chat_model(tmp_path_factory, tiny_chat_model) -> Path:
    """Another tiny random model with the same tokenizer: the routed pair's models differ, so each
    writes tokens the other would not have."""
    path = make_tiny_qwen3(tmp_path_factory.mktemp("tiny_chat_b"), vocab=49152, seed=11)
    for f in tiny_chat_model.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy2(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def engine(tiny_chat_model) -> Engine:
    return Engine.from_pretrained(tiny_chat_model, num_kv_tokens=4096)


def test_engine_alone_follows_regex_choice_and_grammar(engine):
    so = StructuredOutput.of("regex", r"[a-z]{3}-[0-9]{2}")
    for o in engine.generate([f"prompt {i}" for i in range(4)], max_tokens=40, temperature=1.0, seed=4, structured=so):
        assert o.finish_reason == "stop" and re.fullmatch(r"[a-z]{3}-[0-9]{2}", o.text), o.text
    choices = ["yes", "no way", 'say "hi"\n']
    outs = engine.generate([f"question {i}" for i in range(6)],
                           [SamplingParams(max_tokens=30, temperature=1.0, seed=i, structured=StructuredOutput.of("choice", choices))
                            for i in range(6)])
    for o in outs:
        # the response ends at the choice's last token: no step spent on an EOS the grammar forces
        assert o.finish_reason == "stop" and o.text in choices, o.text
        assert engine.model_config.eos_token_ids[0] not in o.token_ids
    assert len({o.text for o in outs}) > 1  # sampled: the mask leaves the choice to the model
    g = StructuredOutput.of("grammar", 'root ::= "(" [0-9] ("+" [0-9])? ("+" [0-9])? ")"')
    for o in engine.generate([f"sum {i}" for i in range(3)], max_tokens=30, temperature=1.0, seed=2, structured=g):
        assert o.finish_reason == "stop" and re.fullmatch(r"\([0-9](\+[0-9]){0,2}\)", o.text), o.text


def test_padding_rows_and_disallowed_tokens_are_masked_only_for_constrained_rows(engine):
    """Logits with more rows than the tokenizer's vocabulary (a model's padding rows): a
    constrained row can draw none of them, an unconstrained row is left exactly as it was."""
    grammars = Grammars(engine.tokenizer, engine.model_config.eos_token_ids)
    V = grammars.vocab_size
    state = grammars.state(StructuredOutput.of("choice", ["red", "green"]))

    class Seq:  # what the sampler reads of a row: its output stream's grammar state
        def __init__(self, grammar):
            self.output = type("Out", (), {"grammar": grammar})()

    logits = torch.randn(3, V + 64)
    logits[:, V:] = 1e4  # the padding rows would win every draw
    params = [SamplingParams(structured=state.spec), SamplingParams(), SamplingParams(structured=state.spec)]
    seqs = [Seq(state), Seq(None), Seq(state)]
    out = apply_grammar(logits, params, seqs)
    assert torch.equal(out[1], logits[1])  # untouched
    allowed = torch.isfinite(out[0])
    assert not allowed[V:].any() and 0 < int(allowed.sum()) < 50
    firsts = {engine.tokenizer.decode([t]) for t in allowed.nonzero().flatten().tolist()}
    assert all("red".startswith(f) or "green".startswith(f) for f in firsts), firsts
    eos = engine.model_config.eos_token_ids[0]
    assert not allowed[eos]  # EOS only where the grammar accepts: not before a choice is written
    digits = grammars.state(StructuredOutput.of("regex", "[0-9]+"))
    assert not any(digits.accept(t) for t in engine.tokenizer.encode("12"))  # complete, yet it may go on
    after = torch.isfinite(apply_grammar(logits[:1], [SamplingParams(structured=digits.spec)], [Seq(digits)])[0])
    assert after[eos] and after[engine.tokenizer.encode("3")[0]] and not after[engine.tokenizer.encode("a")[0]]
    for draw in (sample, sample_batched):  # the CPU sampler and the GPU one (run here on the CPU)
        toks = draw(logits, params, [None] * 3, seqs=seqs)
        assert toks[1] >= V and allowed[toks[0]] and allowed[toks[2]], (draw.__name__, toks)
    assert apply_grammar(logits, [SamplingParams()] * 3, None) is logits  # no row asks: no op, no copy


def test_each_distinct_schema_is_compiled_once(engine):
    """Requests that share a schema share its compiled grammar (xgrammar's cache): a second compile
    adds nothing to the cache, a different schema does; each request still gets a matcher of its own."""
    g = Grammars(engine.tokenizer, engine.model_config.eos_token_ids)
    g.compile(StructuredOutput.of("json", SCHEMA))
    size = g.compiler.get_cache_size_bytes()
    a, b = g.state(StructuredOutput.of("json", json.dumps(SCHEMA))), g.state(StructuredOutput.of("json", dict(SCHEMA)))
    assert size > 0 and g.compiler.get_cache_size_bytes() == size and a.matcher is not b.matcher
    g.compile(StructuredOutput.of("regex", "[a-z]+"))
    assert g.compiler.get_cache_size_bytes() > size


def test_bad_constraints_name_their_field():
    with pytest.raises(ValueError, match="structured_outputs: give exactly one of"):
        StructuredOutput.from_mapping({"json": {"type": "object"}, "regex": "a+"})
    with pytest.raises(ValueError, match="structured_outputs.jsonx: not supported"):
        StructuredOutput.from_mapping({"jsonx": {}})
    with pytest.raises(ValueError, match="guided_choice: choices must be a non-empty list"):
        StructuredOutput.of("choice", [], "guided_choice")
    with pytest.raises(ValueError, match="guided_json: the JSON schema is not valid JSON"):
        StructuredOutput.of("json", "{not json", "guided_json")


async def test_routed_pair_json_schema_outputs_validate_on_20_prompts(tiny_chat_model, second_chat_model):
    """The acceptance check: 20 prompts through the server on a routed pair of different models,
    chat and completions, each answer a finished JSON document that validates against the schema."""
    models = {"small": str(tiny_chat_model), "large": str(second_chat_model)}
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    async with running_server(models, policy_args={"p": 0.5, "seed": 1}) as (url, _, router):
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        texts = []
        for i in range(20):
            if i % 2:
                r = await c.chat.completions.create(model="aiorouter", max_tokens=MAX_TOKENS, temperature=1.0, seed=i,
                                                    messages=[{"role": "user", "content": f"Describe thing {i}."}],
                                                    response_format=rf)
                texts.append((r.choices[0].message.content, r.choices[0].finish_reason))
            else:
                r = await c.completions.create(model="aiorouter", prompt=f"Thing {i} as JSON:", max_tokens=MAX_TOKENS,
                                               temperature=1.0, seed=i, extra_body={"response_format": rf})
                texts.append((r.choices[0].text, r.choices[0].finish_reason))
        for text, reason in texts:
            assert reason == "stop", (text, reason)
            jsonschema.validate(json.loads(text), SCHEMA)
        assert len({t for t, _ in texts}) > 10  # sampled answers, not one forced string
        committed = {n: m.tokens_committed for n, m in router.metrics.models.items()}
        assert all(v > 0 for v in committed.values()), committed  # both models wrote under the grammar


async def test_server_fields_json_object_regex_choice_grammar_and_bad_requests(tiny_chat_model):
    from test_server import pair
    tok = Engine.from_pretrained(tiny_chat_model, num_kv_tokens=256).tokenizer
    quote, close = tok.encode('"')[0], tok.encode('}')[0]
    async with running_server(pair(tiny_chat_model), policy_args={"p": 0.4, "seed": 3}) as (url, _, router):
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        msgs = [{"role": "user", "content": "Answer."}]
        # json_object: any JSON object; the biases on '"' and '}' close the strings and objects a
        # random model opens (without the second, one seed in a full run nested past 200 tokens)
        for seed in range(4):
            r = await c.chat.completions.create(model="aiorouter", messages=msgs, max_tokens=200, temperature=1.0,
                                                seed=seed, response_format={"type": "json_object"},
                                                logit_bias={str(quote): 8, str(close): 4})
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        cases = [({"structured_outputs": {"regex": r"[0-9]{4}"}}, lambda t: re.fullmatch(r"[0-9]{4}", t)),
                 ({"guided_regex": r"(ab|cd){2}"}, lambda t: re.fullmatch(r"(ab|cd){2}", t)),
                 ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
                 ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
                 ({"guided_grammar": 'root ::= "x" [a-c] "y"'}, lambda t: re.fullmatch(r"x[a-c]y", t)),
                 ({"structured_outputs": {"grammar": 'start: "z" DIGIT "z"\nDIGIT: /[0-9]/\n'}},  # Lark's syntax
                  lambda t: re.fullmatch(r"z[0-9]z", t)),
                 # both biases, as above: with the quote's alone, CI's machine drew an object still open at 200
                 ({"structured_outputs": {"json_object": True}, "logit_bias": {str(quote): 8, str(close): 4}},
                  lambda t: isinstance(json.loads(t), dict)),
                 ({"guided_json": {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"],
                                   "additionalProperties": False}}, lambda t: json.loads(t)["k"] in (1, 2))]
        for body, ok in cases:
            r = await c.completions.create(model="aiorouter", prompt="Go:", max_tokens=200, temperature=1.0, seed=2,
                                           extra_body=body)
            assert r.choices[0].finish_reason == "stop" and ok(r.choices[0].text), (body, r.choices[0].text)
        # streamed: the chunks join into the constrained text
        chunks = [ch.choices[0].delta.content or "" async for ch in await c.chat.completions.create(
            model="aiorouter", messages=msgs, max_tokens=40, stream=True, extra_body={"guided_choice": ["alpha", "beta"]})]
        assert "".join(chunks) in ("alpha", "beta")
        bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
                "response_format", "nonsense"),
               ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
                "json_schema.schema: required"),
               ({"response_format": {"type": "yaml"}}, "response_format", "'text', 'json_object' or 'json_schema'"),
               ({"guided_regex": "(ab"}, "guided_regex", "cannot compile this regex"),
               ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "cannot compile this grammar"),
               ({"guided_choice": []}, "guided_choice", "non-empty list"),
               ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "give one of them")]
        for body, param, says in bad:
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(model="aiorouter", prompt="Go:", max_tokens=5, extra_body=body)
            assert e.value.body["param"] == param and says in e.value.body["message"], e.value.body
        r = await c.completions.create(model="aiorouter", prompt="Still serving?", max_tokens=5, temperature=0)
        assert r.choices[0].finish_reason == "length" and router.num_active == 0


async def test_a_send_that_commits_a_token_off_the_grammar_fails_only_that_request(tiny_chat_model):
    """A policy's send may commit tokens no model sampled under the mask: the matcher still has to
    accept them; one it refuses fails that request, naming the token, and the router goes on."""
    from policies import STAY, PeerReq, Policy
    engines = [Engine.from_pretrained(tiny_chat_model, num_kv_tokens=1024) for _ in range(2)]
    letter = engines[0].tokenizer.encode("q")[0]

    class Padding(Policy):  # every move from model a commits the sampled token and a "q"
        name = "padding"

        def route(self, result):
            return [1 if result.model == 0 else STAY for _ in result.reqs]

        def send(self, req):
            return PeerReq(req.rid, req.token_ids[req.seen[req.peer]:] + [req.sampled, letter], loc=req.loc)

    async with Router({"a": engines[0], "b": engines[1]}, RouterConfig(policy=Padding())) as r:
        ok = await r.generate("hi", max_tokens=8, structured={"regex": "[a-z]{6}"}, temperature=1.0, seed=1)
        assert re.fullmatch("[a-z]{6}", ok.text) and ok.token_ids[1] == letter  # a "q" is a letter: accepted
        with pytest.raises(RouterError, match=f"token {letter} does not follow the request's structured output"):
            await r.generate("hi", max_tokens=8, structured={"regex": "[0-9]{6}"})
        after = await r.generate("hi", max_tokens=4, ignore_eos=True)
        assert after.finish_reason == "length" and r.num_active == 0


@pytest.mark.slow
async def test_default_pair_json_schema_outputs_validate_on_20_prompts():
    """Issue 40's acceptance check on the real default pair (SmolLM2-135M-Instruct, int4 small and
    full large), routed at random so that both models write under the grammar: 20 sampled answers,
    chat and completions, each finished and valid against the schema."""
    from aiorouter.defaults import default_models
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    async with running_server(default_models(), policy_args={"p": 0.35, "seed": 1}) as (url, _, router):
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        async def one(i: int) -> tuple[str, str]:
            if i % 2:
                r = await c.chat.completions.create(
                    model="aiorouter", max_tokens=MAX_TOKENS, temperature=1.0, seed=i, response_format=rf,
                    messages=[{"role": "user", "content": f"Describe a toy numbered {i} as JSON."}])
                return r.choices[0].message.content, r.choices[0].finish_reason
            r = await c.completions.create(model="aiorouter", prompt=f"A toy numbered {i}, as JSON:",
                                           max_tokens=MAX_TOKENS, temperature=1.0, seed=i,
                                           extra_body={"response_format": rf})
            return r.choices[0].text, r.choices[0].finish_reason

        texts = await asyncio.gather(*(one(i) for i in range(20)))
        for text, reason in texts:
            assert reason == "stop", (text, reason)
            jsonschema.validate(json.loads(text), SCHEMA)
        assert len({t for t, _ in texts}) > 10
        committed = {n: m.tokens_committed for n, m in router.metrics.models.items()}
        assert all(v > 0 for v in committed.values()), committed
        print("default pair, json_schema:", [t for t, _ in texts[:3]], committed)


async def test_a_constraint_no_token_can_continue_fails_as_the_clients_error(tiny_chat_model):
    """A regex that can start but never end (an empty class after "ab") comes to a dead end: the
    grammar allows no token (so does xgrammar 0.2.9's for characters from U+40000 up, the fuzzer's
    find). The request asked for what cannot be done: a 400 (an error event, streamed), not a server
    error, and the server goes on."""
    from test_server import pair
    dead_end = r"ab[^\s\S]"  # "ab" is writable, then nothing is
    async with running_server(pair(tiny_chat_model)) as (url, _, router):
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model="aiorouter", prompt="Go:", max_tokens=20, extra_body={"guided_regex": dead_end})
        assert e.value.body["type"] == "invalid_request_error", e.value.body
        assert "allows no token of the vocabulary here" in e.value.body["message"], e.value.body
        stream = await c.completions.create(model="aiorouter", prompt="Go:", max_tokens=20, stream=True,
                                            extra_body={"guided_regex": dead_end})
        with pytest.raises(openai.APIError, match="allows no token of the vocabulary here") as e:
            async for _ in stream:
                pass
        assert e.value.body["code"] == 400, e.value.body
        r = await c.completions.create(model="aiorouter", prompt="Still serving?", max_tokens=5, temperature=0)
        assert r.choices[0].finish_reason == "length" and router.num_active == 0
        with pytest.raises(RouterRequestError, match=r"after [12] output tokens, the request's structured output"):
            await router.generate("Go:", max_tokens=20, structured={"regex": dead_end})
