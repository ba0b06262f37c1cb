"""Sampling controls (issue 40, item 4): penalties, logit_bias, min_tokens, stop_token_ids, any number
of stop strings, skip_special_tokens, include_stop_str_in_output. The logits they make are checked
against transformers' logits processors (and the obvious formula where transformers has none), the
tokens against a greedy loop over the transformers model, a routed response against one model's,
and each field through the server with the `openai` package."""
from __future__ import annotations

import asyncio
import random

import openai
import pytest
import torch
import transformers
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from aiorouter import Router, RouterConfig
from engines import Engine, SamplingParams
from engines.output import OutputStream
from engines.sampling import apply_controls, sample, sample_batched
from engines.sim import SimEngine, SimRunner, sim_model_config
from test_server import pair as server_pair
from test_server import running_server


class Seq:
    """A row's sequence as the controls read it (engines.sampling.Written)."""

    def __init__(self, prompt: list[int], output: list[int], eos_ids: tuple[int, ...] = (1,)):
        self.token_ids, self.num_prompt_tokens, self.eos_ids = prompt + output, len(prompt), eos_ids


def reference(scores: torch.Tensor, p: SamplingParams, seq: Seq) -> torch.Tensor:
    """One row [V] as transformers' processors make it, in vLLM's order (bias, min_tokens, repetition),
    then presence and frequency, for which transformers has no processor (vLLM's formula)."""
    ids = torch.tensor([seq.token_ids])
    x = scores[None].clone()
    if p.logit_bias:
        x = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias])(ids, x)
    if p.min_tokens:
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(seq.eos_ids))
        x = MinNewTokensLengthLogitsProcessor(seq.num_prompt_tokens, p.min_tokens, stops)(ids, x)
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    out = seq.token_ids[seq.num_prompt_tokens:]
    counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[-1]).float()
    return x[0] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


CONTROLS = [SamplingParams(temperature=0.0),  # asks for nothing: untouched
            SamplingParams(repetition_penalty=1.7),
            SamplingParams(repetition_penalty=0.6, temperature=0.8),  # < 1 favours what was seen
            SamplingParams(presence_penalty=1.5, frequency_penalty=0.4),
            SamplingParams(presence_penalty=-0.5, frequency_penalty=-1.0, temperature=0.5),
            SamplingParams(logit_bias={3: 4.5, 17: -100.0, 250: 0.25}),
            SamplingParams(logit_bias={5: 2.0}, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
            SamplingParams(min_tokens=6, stop_token_ids=(9, 12)),  # still short of it: EOS and both masked
            SamplingParams(min_tokens=6, stop_token_ids=(9,), ignore_eos=True),  # EOS may be drawn
            SamplingParams(min_tokens=2, stop_token_ids=(9,)),  # long enough already: untouched
            SamplingParams(temperature=1.2, top_k=20)]


def rows(n_rows: int, V: int, seed: int) -> tuple[torch.Tensor, list[Seq]]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_rows, V, generator=g) * 3
    rng = random.Random(seed)
    # small alphabets, so that tokens repeat within the prompt, the output and across them; 1 to 5
    # output tokens (rows 7 and 8 are short of min_tokens), and 3 in row 9 (past its 2)
    seqs = [Seq([rng.randrange(V // 4) for _ in range(rng.randrange(1, 30))],
                [rng.randrange(V // 4) for _ in range(3 if i == 9 else rng.randrange(1, 6))])
            for i in range(n_rows)]
    return logits, seqs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_controls_equal_transformers_processors(seed):
    logits, seqs = rows(len(CONTROLS), 300, seed)
    raw = logits.clone()
    got = apply_controls(logits, CONTROLS, seqs)
    assert torch.equal(logits, raw)  # out of place: the step's raw logits stay what policies read
    for r, (p, s) in enumerate(zip(CONTROLS, seqs)):
        want = reference(logits[r], p, s)
        torch.testing.assert_close(got[r], want, rtol=1e-6, atol=1e-6, msg=lambda m: f"row {r} {p}: {m}")
        if not p.adjusts_logits or r == 9:
            assert torch.equal(got[r], logits[r]), r
        else:
            assert not torch.equal(got[r], logits[r]), r  # the control acted on this row


def test_rows_asking_nothing_cost_nothing():
    logits, seqs = rows(4, 100, 3)
    plain = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.9)] * 2
    assert apply_controls(logits, plain, None) is logits  # no copy, and no sequence read
    done = [SamplingParams(min_tokens=1)] * 4  # every response is long enough: nothing to mask
    seqs = [Seq([5, 6], [7, 8]) for _ in range(4)]
    assert apply_controls(logits, done, seqs) is logits
    with pytest.raises(ValueError, match="need the rows' sequences"):
        apply_controls(logits, [SamplingParams(presence_penalty=1.0)] * 4, None)


@pytest.mark.parametrize("fn", [sample, sample_batched])
def test_greedy_rows_take_the_adjusted_argmax(fn):
    logits, seqs = rows(len(CONTROLS), 300, 4)
    greedy = [SamplingParams(**{**{f: getattr(p, f) for f in ("repetition_penalty", "presence_penalty",
                                                                 "frequency_penalty", "logit_bias", "min_tokens",
                                                                 "stop_token_ids", "ignore_eos")},
                                "temperature": 0.0}) for p in CONTROLS]
    # the bias on token 3 is what wins row 5: the raw argmax is another token
    logits[5, 3] = logits[5].max() - 1.0
    got = fn(logits, greedy, [None] * len(greedy), seqs=seqs)
    want = torch.stack([reference(logits[r], p, s) for r, (p, s) in enumerate(zip(greedy, seqs))]).argmax(-1)
    assert torch.equal(got, want)
    assert got[5] == 3 and logits[5].argmax() != 3


def test_sampled_rows_draw_the_adjusted_distribution():
    """The exponential race (GPU sampler) over adjusted logits: the frequencies are the adjusted softmax."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5]])
    seq = Seq([0, 0, 1], [0, 2, 2])
    p = SamplingParams(temperature=0.9, repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2,
                       logit_bias={5: 1.5})
    want = torch.softmax(reference(logits[0], p, seq) / 0.9, -1)
    n = 20000
    for fn in (sample_batched, sample):
        got = fn(logits.expand(n, -1), [p] * n, [None] * n, seqs=[seq] * n)
        freq = torch.bincount(got, minlength=6).float() / n
        assert (freq - want).abs().max() < 0.015, (fn.__name__, freq, want)


@pytest.mark.parametrize("fn", [sample, sample_batched])
def test_seeded_rows_with_controls_do_not_depend_on_the_batch(fn):
    logits, seqs = rows(4, 200, 5)
    p = SamplingParams(temperature=1.0, seed=7, presence_penalty=1.0, logit_bias={3: 2.0})
    alone = fn(logits[2:3], [p], [torch.Generator().manual_seed(7)], seqs=seqs[2:3])
    ps = [SamplingParams(repetition_penalty=1.5), SamplingParams(temperature=0.0), p, SamplingParams(top_k=3)]
    batch = fn(logits, ps, [None, None, torch.Generator().manual_seed(7), None], seqs=seqs)
    assert batch[2] == alone[0]


@pytest.mark.gpu
def test_controls_need_no_host_sync_on_cuda():
    logits, seqs = rows(len(CONTROLS), 1000, 6)
    logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample_batched(logits, CONTROLS, [None] * len(CONTROLS), seqs=seqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = torch.stack([reference(logits[r].cpu(), p, s) for r, (p, s) in enumerate(zip(CONTROLS, seqs))])
    greedy = [r for r, p in enumerate(CONTROLS) if p.greedy]
    assert out.device.type == "cuda" and torch.equal(out.cpu()[greedy], want[greedy].argmax(-1))


@pytest.mark.parametrize("kw, says", [
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty must be a number in [-2, 2]"),
    ({"logit_bias": {5: 101}}, "logit_bias values must be numbers in [-100, 100]"),
    ({"logit_bias": {-1: 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {True: 1}}, "logit_bias keys must be token ids"),
    ({"stop_token_ids": [-2]}, "stop_token_ids must be token ids"),
    ({"min_tokens": 20}, "min_tokens must be an integer in [0, max_tokens=16]"),
    ({"min_tokens": "3"}, "min_tokens must be an integer"),
    ({"skip_special_tokens": 0}, "skip_special_tokens must be true or false"),
])
def test_bad_controls_are_refused_by_name(kw, says):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert says in str(e.value)


def test_logit_bias_is_kept_hashable_and_in_order():
    p = SamplingParams(logit_bias={9: 1, 3: -2.5})
    assert p.logit_bias == ((3, -2.5), (9, 1.0)) and hash(p) == hash(SamplingParams(logit_bias=[(9, 1.0), (3, -2.5)]))


# -- the output path: stop strings, stop tokens, special tokens ---------------------------------------
@pytest.fixture(scope="module")
def tok(tiny_chat_model):
    return transformers.AutoTokenizer.from_pretrained(tiny_chat_model)


def run_stream(tok, ids: list[int], p: SamplingParams, defer: bool, eos: tuple[int, ...] = (2,)):
    """Commit `ids` as a router does (text at commit, or deferred to the reader) -> (text, reason, tokens)."""
    prompt = tok.encode("Say:")
    out = OutputStream(list(prompt), len(prompt), p, eos, 4096, tok, defer_text=defer)
    text = []
    for t in ids:
        c = out.append(t)
        text.append(c.text if c.text is not None else out.text_of(t, c.finish_reason is not None))
        if c.finish_reason is not None:
            break
    return "".join(text), out.finish_reason, out.num_output_tokens


TEXT = " The cat sat on the mat, and the dog sat on the rug by the door."


@pytest.mark.parametrize("defer", [False, True])
def test_any_number_of_stop_strings_earliest_first(tok, defer):
    ids = tok.encode(TEXT)
    stops = ["zebra", "rug", "qq", "mat", "!!", "dog", "xyz"]  # seven: more than OpenAI's four
    text, reason, _ = run_stream(tok, ids, SamplingParams(max_tokens=100, stop=stops), defer)
    assert (text, reason) == (" The cat sat on the ", "stop")
    text, _, _ = run_stream(tok, ids, SamplingParams(max_tokens=100, stop=stops, include_stop_str_in_output=True),
                            defer)
    assert text == " The cat sat on the mat"


def test_a_stop_string_written_before_min_tokens_does_not_stop_later(tok):
    """As vLLM's: each check reads the new text only, and none runs before min_tokens."""
    ids = tok.encode(TEXT)
    n_cat = len(tok.encode(" The cat"))
    text, reason, n = run_stream(tok, ids, SamplingParams(max_tokens=100, stop=["cat", "rug"], min_tokens=n_cat + 1),
                                 False)
    assert reason == "stop" and text == " The cat sat on the mat, and the dog sat on the " and n > n_cat


@pytest.mark.parametrize("defer", [False, True])
def test_stop_token_text_left_out_unless_asked(tok, defer):
    ids = tok.encode(TEXT)
    at = 4
    p = SamplingParams(max_tokens=100, stop_token_ids=(ids[at],))
    prompt = tok.encode("Say:")
    upto = lambda k: tok.decode(prompt + ids[:k])[len(tok.decode(prompt)):]  # noqa: E731
    text, reason, n = run_stream(tok, ids, p, defer)
    assert (text, reason, n) == (upto(at), "stop", at + 1)  # the stop token is an output token, not text
    text, _, _ = run_stream(tok, ids, SamplingParams(max_tokens=100, stop_token_ids=(ids[at],),
                                                     include_stop_str_in_output=True), defer)
    assert text == upto(at + 1)
    # an EOS that decodes to text (skip_special_tokens off) is left out the same way
    eos_text, _, _ = run_stream(tok, ids[:3] + [2], SamplingParams(max_tokens=100, skip_special_tokens=False), defer)
    assert eos_text == upto(3) and "<|im_end|>" not in eos_text


@pytest.mark.parametrize("defer", [False, True])
def test_skip_special_tokens(tok, defer):
    ids = tok.encode(" Hello") + [1] + tok.encode(" world") + [0]  # <|im_start|>, <|endoftext|>
    p = SamplingParams(max_tokens=len(ids), ignore_eos=True)
    assert run_stream(tok, ids, p, defer)[0] == " Hello world"
    shown = run_stream(tok, ids, SamplingParams(max_tokens=len(ids), ignore_eos=True, skip_special_tokens=False),
                       defer)[0]
    assert shown == " Hello<|im_start|> world<|endoftext|>"


# -- tokens: the engine against a greedy loop over the transformers model ----------------------------
def hf_greedy(hf, prompt: list[int], p: SamplingParams, eos: tuple[int, ...], n: int) -> list[int]:
    """Step the transformers model one token at a time, adjust with `reference`, take the argmax."""
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            scores = hf(torch.tensor([ids])).logits[0, -1].float()
        t = int(reference(scores, p, Seq(prompt, ids[len(prompt):], eos)).argmax())
        ids.append(t)
        if len(ids) - len(prompt) >= p.min_tokens and (t in p.stop_token_ids or (not p.ignore_eos and t in eos)):
            break
    return ids[len(prompt):]


def engine_params(n: int) -> list[SamplingParams]:
    g = dict(max_tokens=n, temperature=0.0)
    # the tiny random model's greedy answers hardly repeat a token: the rows whose change is checked
    # favour what was seen (a penalty below 1, negative presence and frequency), which changes them
    return [SamplingParams(ignore_eos=True, **g),
            SamplingParams(repetition_penalty=0.4, ignore_eos=True, **g),
            SamplingParams(presence_penalty=-1.5, frequency_penalty=-2.0, ignore_eos=True, **g),
            SamplingParams(logit_bias={7: 5.0, 300: -100.0, 42: 3.0}, repetition_penalty=1.2, ignore_eos=True, **g),
            SamplingParams(logit_bias={1: 60.0}, min_tokens=5, **g),  # EOS (1) wins once it may
            SamplingParams(repetition_penalty=1.5, presence_penalty=1.5, frequency_penalty=0.7, stop_token_ids=(2,),
                           ignore_eos=True, **g)]


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(11)
    return [[rng.randrange(2, 60) for _ in range(rng.randrange(3, 30))] for _ in range(6)]


N = 20


def test_engine_tokens_equal_transformers_greedy_with_controls(tiny_qwen3, prompts):
    eng = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=4096)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    eos = eng.model_config.eos_token_ids
    params = engine_params(N)
    outs = eng.generate(prompts, params)  # one batch: rows with and without controls together
    plain = eng.generate(prompts, max_tokens=N, temperature=0.0, ignore_eos=True)
    for i, (pr, p, o) in enumerate(zip(prompts, params, outs)):
        assert o.token_ids == hf_greedy(hf, pr, p, eos, N), (i, p)
        if i in (1, 2, 3):
            assert o.token_ids != plain[i].token_ids, i  # the control changed the answer
    assert outs[4].token_ids[:5] != [1] * 5 and outs[4].token_ids[5] == 1 and outs[4].finish_reason == "stop"
    assert len(outs[4].token_ids) == 6


async def test_routed_response_with_controls_equals_one_model(tiny_qwen3, prompts):
    """Two identical models handing the request back and forth: the penalties count every token of
    the response whichever model wrote it, so the answer is the single model's."""
    eng = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=4096)
    params = engine_params(N)
    ref = eng.generate(prompts, params)
    cfg = RouterConfig(entry="small", policy="random", policy_args={"p": 0.4, "seed": 3})
    async with Router({"small": str(tiny_qwen3), "large": str(tiny_qwen3)}, cfg) as r:
        res = await asyncio.gather(*(r.generate(pr, **kwargs(p)) for pr, p in zip(prompts, params)))
        assert {m for x in res for m in x.models} == {"small", "large"}
        assert sum(r.metrics.handoffs.values()) > 10
    for x, o in zip(res, ref):
        assert x.token_ids == o.token_ids and x.finish_reason == o.finish_reason


def kwargs(p: SamplingParams) -> dict:
    return dict(max_tokens=p.max_tokens, temperature=p.temperature, ignore_eos=p.ignore_eos,
                repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty, logit_bias=dict(p.logit_bias),
                stop_token_ids=list(p.stop_token_ids), min_tokens=p.min_tokens)


def sim_greedy(prompt: list[int], p: SamplingParams) -> list[int]:
    """A sim's logits (token_seed 0, as SimEngine's default), step by step, adjusted by `reference`:
    the tokens its engine should pick."""
    sim = SimRunner(sim_model_config(), 0.0, 0.0, token_seed=0)
    out: list[int] = []
    while len(out) < p.max_tokens:
        seq = Seq(prompt, out, (256,))
        logits, _ = sim.next_logits([seq])
        out.append(int(reference(logits[0], p, seq).argmax()))
        if len(out) >= p.min_tokens and out[-1] == 256:
            break
    return out


def test_sim_engine_applies_controls():
    """The sim's logits are zeros but for its token's (1 to 12): a bias of 50 wins every step, until
    a repetition penalty of 100 brings it to 0.5 once the token is in the response."""
    sim = SimEngine(latency_a=0.0)
    for kw in ({"logit_bias": {66: 50.0}}, {"logit_bias": {66: 50.0}, "repetition_penalty": 100.0},
               {"logit_bias": {66: 12.5}, "presence_penalty": 1.0, "frequency_penalty": 0.5},
               {"logit_bias": {256: 50.0}, "min_tokens": 4}):
        p = SamplingParams(max_tokens=12, temperature=0.0, **kw)
        got = sim.generate([[70, 71]], p)[0]
        assert got.token_ids == sim_greedy([70, 71], p), kw
    assert got.token_ids[4] == 256 and 256 not in got.token_ids[:4] and got.finish_reason == "stop"
    biased = sim.generate([[70, 71]], max_tokens=12, temperature=0.0, logit_bias={66: 50.0})[0]
    assert biased.token_ids == [66] * 12


async def test_routed_sims_with_controls_equal_one_sim():
    kw = dict(max_tokens=16, temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5,
              logit_bias={66: 2.0})
    ref = SimEngine(latency_a=0.0).generate([[70, 71, 72]], **kw)[0]
    cfg = RouterConfig(entry="a", policy="random", policy_args={"p": 0.5, "seed": 1})
    async with Router({"a": SimEngine(latency_a=0.0), "b": SimEngine(latency_a=0.0)}, cfg) as r:
        got = await r.generate([70, 71, 72], **kw)
    assert got.token_ids == ref.token_ids and set(got.models) == {"a", "b"}


def test_engine_refuses_token_ids_past_its_vocabulary(tiny_qwen3):
    eng = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=1024)
    for kw, field in (({"logit_bias": {512: 1.0}}, "logit_bias"), ({"stop_token_ids": (600,)}, "stop_token_ids")):
        with pytest.raises(ValueError, match=f"{field}: token id .* is outside the vocabulary"):
            eng.add_request([5, 6], SamplingParams(**kw))


# -- through the server, with the openai package -------------------------------------------------------
def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


PROMPT = "Once upon a time"


async def test_server_honours_every_control(tiny_chat_model):
    eng = Engine.from_pretrained(tiny_chat_model, num_kv_tokens=2048)
    eos = eng.model_config.eos_token_ids

    def ref(**kw) -> object:  # the single model, greedy, with the same controls
        return eng.generate(PROMPT, max_tokens=16, temperature=0.0, **kw)[0]

    plain = ref(ignore_eos=True)
    async with running_server(server_pair(tiny_chat_model)) as (url, server, router):
        c = client(url)

        async def complete(**kw):
            extra = {k: kw.pop(k) for k in list(kw) if k not in ("presence_penalty", "frequency_penalty",
                                                                  "logit_bias", "stop")}
            return await c.completions.create(model="aiorouter", prompt=PROMPT, max_tokens=16, temperature=0.0,
                                              extra_body=extra, **kw)

        # penalties and logit_bias: the single model's answer; the tiny model's plain answer repeats no
        # token, so the controls that favour what was seen are the ones sure to change it
        for kw, changes in (({"presence_penalty": -2.0, "frequency_penalty": -1.0}, True),
                            ({"repetition_penalty": 0.3}, True),
                            ({"logit_bias": {str(plain.token_ids[1]): -100, "300": 4}}, True),
                            ({"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.8}, False)):
            r = await complete(ignore_eos=True, **kw)
            want = ref(ignore_eos=True, **{k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v)
                                            for k, v in kw.items()})
            assert r.choices[0].text == want.text, kw
            assert not changes or want.text != plain.text, kw
        # stop_token_ids: the answer ends at that token (its text left out)
        stop_at = plain.token_ids[5]
        r = await complete(ignore_eos=True, stop_token_ids=[stop_at])
        cut = plain.token_ids.index(stop_at) + 1
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == cut
        assert r.choices[0].text == ref(ignore_eos=True, stop_token_ids=(stop_at,)).text
        r = await complete(ignore_eos=True, stop_token_ids=[stop_at], include_stop_str_in_output=True)
        kept = ref(ignore_eos=True, stop_token_ids=(stop_at,), include_stop_str_in_output=True).text
        without = ref(ignore_eos=True, stop_token_ids=(stop_at,)).text
        assert r.choices[0].text == kept == plain.text[:len(kept)] and len(kept) > len(without)
        # min_tokens: EOS is the only likely token, and still comes after min_tokens others
        r = await complete(logit_bias={str(eos[0]): 100}, min_tokens=4)
        assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (5, "stop")
        r = await complete(logit_bias={str(eos[0]): 100})
        assert r.usage.completion_tokens == 1
        # six stop strings, the one that appears among them
        word = plain.text[len(plain.text) // 2:len(plain.text) // 2 + 3]
        stops = ["@@@", "###", word, "$$$", "%%%", "^^^"]
        r = await complete(ignore_eos=True, stop=stops)
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text == plain.text[:plain.text.index(word)]
        r = await complete(ignore_eos=True, stop=stops, include_stop_str_in_output=True)
        assert r.choices[0].text == plain.text[:plain.text.index(word) + len(word)]
        # skip_special_tokens: a special token (not an EOS) made certain, shown only when asked
        special = next(t for t in eng.tokenizer.all_special_ids if t not in eos)
        name = eng.tokenizer.convert_ids_to_tokens(special)
        r = await complete(ignore_eos=True, logit_bias={str(special): 100}, max_tokens=3)
        assert r.choices[0].text == "" and r.usage.completion_tokens == 3
        r = await complete(ignore_eos=True, logit_bias={str(special): 100}, max_tokens=3, skip_special_tokens=False)
        assert r.choices[0].text == name * 3

        # chat, streamed: the same controls, the same text as the whole answer
        msgs = [{"role": "user", "content": "Tell me a story about a cat."}]
        kw = dict(model="aiorouter", messages=msgs, max_tokens=16, temperature=0.0, presence_penalty=1.0,
                  frequency_penalty=0.3, stop=stops, extra_body={"ignore_eos": True, "repetition_penalty": 1.3,
                                                               "min_tokens": 2})
        whole = await c.chat.completions.create(**kw)
        stream = await c.chat.completions.create(stream=True, **kw)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        ids = router.prompt_ids(msgs)
        want = eng.generate(ids, max_tokens=16, temperature=0.0, presence_penalty=1.0, frequency_penalty=0.3,
                            stop=stops, ignore_eos=True, repetition_penalty=1.3, min_tokens=2)[0]
        assert text == whole.choices[0].message.content == want.text
        assert router.num_active == 0
