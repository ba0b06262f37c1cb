"""The soak's client side: one mixed request at a time through the official `openai` client, each
with the outcome it was meant to have (bench/soak.py runs 32 of these loops against a server).

A request is one of: a normal chat or completion (streaming or not, text or token ids, short,
medium or long behind a shared prefix, sometimes with a routing override, a stop string or a
seed), 10% of them abandoned by the client mid-way; a bad request (must get a 4xx); a request
marked for a fault by the server's fault plan (must end with the error that fault causes, naming
the model); or, in bursts, a long distinct prompt that drives the large model's KV pool empty.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import openai

MODEL = "aiorouter"
VOCAB = 49152  # SmolLM2's, which the cpu-tiny chat pair speaks
AFTER = 2  # output tokens a marked request commits before its fault fires (the plan's `after`)
# fault kind -> the error it must end with; the markers start with ids no random prompt begins with
EXPECTED = {"step": "failed a step: InjectedFault", "nan": "produced non-finite logits (NaN or inf)",
            "inf": "produced non-finite logits (NaN or inf)", "route": "raised in route on model",
            "send": "raised in send on model", "receive": "raised in receive on model"}
MARKERS = {kind: [49101, 49102, 49110 + i] for i, kind in enumerate(EXPECTED)}
OVERRIDES = [{"policy": "rstitch", "tau": 0.5}, {"policy": "random", "p": 0.1}, {"policy": "single"},
             {"policy": "random", "p": 0.6}]
WORDS = ("the a of to and in is it that for on with as was at by an be this from or have not are but what all "
         "were when we there can your which their said if do will each about how up out them then she many some "
         "so these would other into has more her two like him see time could no make than first been its who now "
         "people my made over did down only way find use may water long little very after words called just where "
         "most know get through back much go good new write our me man too any day same right look think also "
         "around another came come work three word must because does part even place well such here take why "
         "things help put years different away again off went old number great tell men say small every found "
         "still between name should home big give air line set own under read last never us left end along while "
         "might next sound below saw something thought both few those always looked show large often together "
         "asked house world going want school important until form food keep children feet land side without boy "
         "once animals life enough took sometimes four head above kind began almost live page got earth need far "
         "hand high year mother light parts country father let night following picture being study second eyes "
         "soon times story boys since white days ever paper hard near sentence better best across during today "
         "others however sure means knew its try told young miles sun ways thing whole hear example heard several "
         "change answer room sea against top turned learn point city play toward five using himself usually").split()


@dataclass
class Outcome:
    kind: str  # "normal" | "burst" | "bad" | "fault"
    result: str  # "completed" | "disconnected" | "rejected" | "injected" | "failed" | "not_fired"
    t_end: float  # perf_counter at the end
    latency: float  # seconds, send to last byte
    ttft: float | None = None
    detail: str = ""  # for a failure: what happened


class Mix:
    """Draws requests (seeded: the same mix each run, in an order that timing shuffles)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        prefix_rng = random.Random(seed + 1)
        # shared long prefixes: a few "system prompts" many requests start with (the prefix cache's work)
        self.prefixes = [" ".join(prefix_rng.choice(WORDS) for _ in range(prefix_rng.randrange(200, 300)))
                         for _ in range(3)]
        self.fault_turn = 0
        self.sent = 0

    def words(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randrange(lo, hi)))

    def ids(self, lo: int, hi: int) -> list[int]:
        return [self.rng.randrange(300, 49000) for _ in range(self.rng.randrange(lo, hi))]

    def text(self) -> str:
        r = self.rng.random()
        if r < 0.5:
            return self.words(3, 30)
        if r < 0.75:
            return self.words(30, 120)
        return self.rng.choice(self.prefixes) + "\n\n" + self.words(5, 30)  # long, behind a shared prefix

    def kind(self) -> str:
        """One request in 12 is marked for a fault (the kinds in turn: each fires within the first
        ~75 requests, so a 2-minute run on a loaded machine meets every one), one in 25 is bad."""
        self.sent += 1
        return "fault" if self.sent % 12 == 7 else "bad" if self.sent % 25 == 19 else "normal"

    def next_fault(self) -> str:
        self.fault_turn += 1
        return list(EXPECTED)[self.fault_turn % len(EXPECTED)]


async def normal(client: openai.AsyncOpenAI, mix: Mix, kind: str = "normal", prompt_ids: list[int] | None = None,
                 routing: dict | None = None, max_tokens: int | None = None) -> Outcome:
    rng = mix.rng
    chat = prompt_ids is None and rng.random() < 0.5
    stream = rng.random() < 0.5
    disconnect = kind == "normal" and rng.random() < 0.10
    max_tokens = max_tokens or rng.randrange(4, 32)
    body: dict = {"ignore_eos": rng.random() < 0.7}
    if routing is not None or rng.random() < 0.3:
        body["routing"] = dict(routing or rng.choice(OVERRIDES))
    kw: dict = {"model": MODEL, "max_tokens": max_tokens, "stream": stream, "extra_body": body}
    if rng.random() < 0.4:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.uniform(0.6, 1.0), seed=rng.randrange(1 << 30))
        if rng.random() < 0.3:
            kw["top_p"] = 0.9
    stop = rng.random() < 0.1
    if stop:
        kw["stop"] = [rng.choice(WORDS[:20])]
    if stream:
        kw["stream_options"] = {"include_usage": True}
    if chat:
        call = client.chat.completions.create
        kw["messages"] = ([{"role": "system", "content": rng.choice(mix.prefixes)}] if rng.random() < 0.3 else []) + \
            [{"role": "user", "content": mix.text()}]
    else:
        call = client.completions.create
        kw["prompt"] = prompt_ids or (mix.ids(5, 120) if rng.random() < 0.3 else mix.text())
    exact = body["ignore_eos"] and not stop  # then exactly max_tokens must come back
    cut_after = rng.randrange(1, 4) if disconnect and stream else None
    t0 = time.perf_counter()
    ttft, usage, reason, n_chunks = None, None, None, 0
    try:
        if not stream:
            coro = call(**kw)
            r = await (asyncio.wait_for(coro, rng.uniform(0.05, 1.0)) if disconnect else coro)
            usage, reason = r.usage, r.choices[0].finish_reason
        else:
            s = await call(**kw)
            async for chunk in s:
                if chunk.choices:
                    n_chunks += 1
                    ttft = ttft or time.perf_counter() - t0
                    reason = chunk.choices[0].finish_reason or reason
                    if cut_after is not None and n_chunks >= cut_after:
                        await s.close()  # the client goes away mid-stream
                        return Outcome(kind, "disconnected", time.perf_counter(), time.perf_counter() - t0, ttft)
                if chunk.usage:
                    usage = chunk.usage
    except asyncio.TimeoutError:
        return Outcome(kind, "disconnected", time.perf_counter(), time.perf_counter() - t0)
    except openai.APIError as e:
        return Outcome(kind, "failed", time.perf_counter(), time.perf_counter() - t0, ttft, f"{type(e).__name__}: {e}")
    t1 = time.perf_counter()
    bad = None
    if reason not in ("stop", "length") or usage is None:
        bad = f"finish_reason {reason!r}, usage {usage!r}"
    elif usage.completion_tokens > max_tokens or (exact and usage.completion_tokens != max_tokens):
        bad = f"{usage.completion_tokens} tokens for max_tokens={max_tokens} (exact: {exact})"
    elif sum(usage.model_extra["per_model"].values()) != usage.completion_tokens:
        bad = f"per-model counts {usage.model_extra['per_model']} do not add up to {usage.completion_tokens}"
    return Outcome(kind, "failed" if bad else "completed", t1, t1 - t0, ttft, bad or "")


async def fault(client: openai.AsyncOpenAI, mix: Mix) -> Outcome:
    """A request marked for the next fault kind: it must end with that fault's error."""
    rng, kind = mix.rng, mix.next_fault()
    stream = rng.random() < 0.5
    body: dict = {"ignore_eos": True}
    if kind in ("send", "receive"):  # these fire on a handoff: make one all but certain
        body["routing"] = {"policy": "random", "p": 0.9}
    kw = dict(model=MODEL, prompt=MARKERS[kind] + mix.ids(5, 40), max_tokens=AFTER + 6, stream=stream,
              temperature=0.0, extra_body=body)
    t0 = time.perf_counter()
    chunks = 0
    try:
        if stream:
            async for c in await client.completions.create(**kw):
                chunks += bool(c.choices and c.choices[0].text)
        else:
            await client.completions.create(**kw)
    except openai.APIError as e:
        status = getattr(e, "status_code", None)
        # step, nan, inf and route fire at the step that samples output token AFTER; send and receive
        # at the first handoff after that, so a request that stays on its model a step longer
        # (10% a step with p=0.9) streams more tokens first
        most = AFTER if kind in ("step", "nan", "inf", "route") else kw["max_tokens"] - 1
        ok = EXPECTED[kind] in e.message and "model '" in e.message and \
            (status == 500 if not stream else status is None and chunks <= most)
        return Outcome(f"fault:{kind}", "injected" if ok else "failed", time.perf_counter(), time.perf_counter() - t0,
                       detail="" if ok else f"{kind}: status {status}, {chunks} chunks: {e.message}")
    return Outcome(f"fault:{kind}", "not_fired", time.perf_counter(), time.perf_counter() - t0,
                   detail=f"{kind}: the marked request completed")


def bad_requests(mix: Mix) -> list[tuple[str, dict, str]]:
    """(what, create() arguments, endpoint): each must be refused with a 4xx."""
    M = MODEL
    return [
        ("max_tokens over the context", dict(model=M, prompt="hi", max_tokens=10**9), "completions"),
        ("unknown field", dict(model=M, prompt="hi", extra_body={"frobnicate": 1}), "completions"),
        ("unknown routing policy", dict(model=M, prompt="hi", extra_body={"routing": {"policy": "nope"}}), "completions"),
        ("empty messages", dict(model=M, messages=[]), "chat"),
        ("token id outside the vocabulary", dict(model=M, prompt=[5, 6, 10**7]), "completions"),
        ("unknown model", dict(model="gpt-9", prompt="hi"), "completions"),
        ("n > 1", dict(model=M, messages=[{"role": "user", "content": "hi"}], n=2), "chat"),
        ("presence penalty", dict(model=M, prompt="hi", presence_penalty=0.5), "completions"),
        ("negative temperature", dict(model=M, prompt="hi", temperature=-1), "completions"),
        ("prompt over the context", dict(model=M, prompt=[7] * 9000), "completions"),
    ]


async def bad(client: openai.AsyncOpenAI, mix: Mix) -> Outcome:
    what, kw, endpoint = mix.rng.choice(bad_requests(mix))
    call = client.chat.completions.create if endpoint == "chat" else client.completions.create
    t0 = time.perf_counter()
    try:
        await call(**kw)
        result, detail = "failed", f"bad request ({what}) was accepted"
    except openai.APIStatusError as e:
        ok = 400 <= e.status_code < 500 and bool(e.message)
        result, detail = ("rejected", "") if ok else ("failed", f"bad request ({what}): {e.status_code} {e.message}")
    except openai.APIError as e:
        result, detail = "failed", f"bad request ({what}): {type(e).__name__}: {e}"
    return Outcome("bad", result, time.perf_counter(), time.perf_counter() - t0, detail=detail)


async def one(client: openai.AsyncOpenAI, mix: Mix) -> Outcome:
    kind = mix.kind()
    if kind == "bad":
        return await bad(client, mix)
    if kind == "fault":
        return await fault(client, mix)
    return await normal(client, mix)


async def burst(client: openai.AsyncOpenAI, mix: Mix, n: int, prompt_len: int) -> list[Outcome]:
    """`n` long distinct prompts at once, sent on to the large model: its KV pool runs dry, so the
    scheduler must wait and preempt, and every one of them must still complete."""
    prompts = [mix.ids(prompt_len, prompt_len + 100) for _ in range(n)]
    return await asyncio.gather(*(normal(client, mix, "burst", p, {"policy": "random", "p": 0.9}, 12)
                                  for p in prompts))
