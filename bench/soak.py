"""Soak: a long mixed load on `aiorouter serve` with failures on purpose; nothing may leak, creep or wedge.

    python -m bench.soak [--minutes 30] [--quick] [--out bench/results]

Starts `aiorouter serve` on the cpu-tiny pair (with SmolLM2's tokenizer, bench/common.py) as a real
subprocess, with a test-only fault plan (aiorouter/faults.py), and drives it through the `openai`
client from 32 concurrent loops plus bursts of long prompts that drive the large model's KV pool
dry. A loop's request is one of: a normal chat or completion (streaming or not, text or token ids,
short, medium or long behind a shared prefix, sometimes with a routing override, a stop string or
a seed), 10% of them abandoned by the client mid-way; a bad request (must get a 4xx); or a request
marked for a fault by the server's fault plan (must end with the error that fault causes, naming
the model). A burst is long distinct prompts that must all complete. Meanwhile
it samples the server's RSS (/proc) and /metrics every 2 s and its /health every second. After
the load it waits for the server to drain, reads the KV pages still in use, flushes the prefix
cache (POST /reset_prefix_cache) and reads them again, then stops the server with SIGTERM.

The server runs with glibc malloc "bounded" (MALLOC below; --malloc stock for the default settings,
whose retention of freed step-sized tensors reads as RSS growth). Before the warm-up it writes every page of both KV pools once (`touch_kv`: the pools are `torch.empty`,
so their first fill would otherwise read as RSS growth).

Writes DIR/soak.json (the figures, the checks, the timelines), DIR/soak.png, DIR/soak-server.log, and
the figures and checks as DIR/soak.md (`--render DIR/soak.json` writes it again from a saved run).
Exits 1 when a check fails. `--quick` is 2 minutes of load after a 60 s warm-up (tests/test_soak.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import openai

from bench.common import RESULTS, ROOT, free_port, machine, rel, tiny_chat_qwen3, wait_healthy

CONCURRENCY = 32
# The server's glibc malloc. "stock": as `aiorouter serve` runs by default. "bounded": two arenas and a
# fixed mmap threshold, so a freed tensor of 1 MiB or more goes back to the OS. The RSS check is for
# leaks: with stock, glibc's retention of freed step-sized tensors reads as growth (2-minute runs on
# the loaded 2-core machine: +9 % and +13 % first to last minute; bounded ran ~300 MB lower).
MALLOC = {"stock": {}, "bounded": {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}}


# -- the load: one mixed request at a time, each with the outcome it was meant to have -----------------
MODEL = "aiorouter"
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


# -- the soak ------------------------------------------------------------------------------------------

def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (comments dropped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def per_model(m: dict[str, float], name: str) -> dict[str, int]:
    return {k.split('model="')[1].split('"')[0]: int(v) for k, v in m.items() if k.startswith(name + "{")}


class Soak:
    def __init__(self, args, url: str, proc: subprocess.Popen):
        self.args, self.url, self.proc = args, url, proc
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        self.mix = Mix(args.seed)
        self.outcomes: list[Outcome] = []
        self.timeline: list[list[float]] = []  # [t, rss MB, kv used small, large, kv cached small, large, active, loop tasks]
        self.health = {"checks": 0, "failures": 0, "max_latency_s": 0.0, "errors": []}
        self.kv_peak: dict[str, int] = {}
        self.kv_touched: dict[str, int] = {}  # pages held after touch_kv (used + cached)
        self.t_load = 0.0  # perf_counter when the measured load starts (after the warm-up)
        self.stop_at = 0.0

    async def metrics(self, http: aiohttp.ClientSession) -> dict[str, float]:
        async with http.get(self.url + "/metrics") as r:
            return parse_metrics(await r.text())

    async def loop_tasks(self) -> float | None:
        """The server's event-loop task count, asked on a connection of its own that closes after:
        every open keep-alive connection holds a handler task, and this one must be the only one."""
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            m = await self.metrics(http)
        if "aiorouter_event_loop_tasks" not in m:
            return None
        # a drift re-solve of the thresholds is one task while it runs (minutes on a loaded machine)
        return m["aiorouter_event_loop_tasks"] - m.get("aiorouter_tuning_resolving", 0)

    # -- background watchers ---------------------------------------------------------------------
    async def watch_health(self, http: aiohttp.ClientSession, done: asyncio.Event) -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            try:
                async with http.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    ok = r.status == 200
                    err = f"status {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                ok, err = False, repr(e)
            dt = time.perf_counter() - t0
            self.health["checks"] += 1
            self.health["max_latency_s"] = max(self.health["max_latency_s"], round(dt, 3))
            if not ok:
                self.health["failures"] += 1
                self.health["errors"] = (self.health["errors"] + [f"t={t0 - self.t_load:.0f}s: {err}"])[-10:]
            await asyncio.sleep(max(0.0, 1.0 - dt))

    async def watch(self, http: aiohttp.ClientSession, done: asyncio.Event) -> None:
        while not done.is_set():
            t = time.perf_counter()
            m = await self.metrics(http)
            used, cached = per_model(m, "aiorouter_kv_pages_used"), per_model(m, "aiorouter_kv_pages_cached")
            for k, v in used.items():
                self.kv_peak[k] = max(self.kv_peak.get(k, 0), v)
            self.timeline.append([round(t - self.t_load, 2), round(rss_mb(self.proc.pid), 1), used.get("small", 0),
                                  used.get("large", 0), cached.get("small", 0), cached.get("large", 0),
                                  m.get("aiorouter_requests_active", 0), m.get("aiorouter_event_loop_tasks", 0)])
            await asyncio.sleep(max(0.0, 2.0 - (time.perf_counter() - t)))

    # -- load ----------------------------------------------------------------------------------
    async def worker(self) -> None:
        while time.perf_counter() < self.stop_at:
            try:
                self.outcomes.append(await one(self.client, self.mix))
            except Exception as e:  # a bug on this side still counts, and the loop goes on
                self.outcomes.append(Outcome("client", "failed", time.perf_counter(), 0.0, detail=f"client: {e!r}"))

    async def bursts(self, every_s: float, n: int, prompt_len: int) -> None:
        """A burst every `every_s` from `every_s / 2` on, on the clock: a slow burst does not push the
        next one later (or past the end of the load)."""
        async def one() -> None:
            print(f"[{time.perf_counter() - self.t_load:6.0f}s] KV burst: {n} prompts of ~{prompt_len} tokens", flush=True)
            self.outcomes.extend(await burst(self.client, self.mix, n, prompt_len))

        tasks, t = [], self.t_load + every_s / 2
        while t < self.stop_at - 20:
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            tasks.append(asyncio.create_task(one()))
            t += every_s
        await asyncio.gather(*tasks)

    async def progress(self, done: asyncio.Event) -> None:
        while not done.is_set():
            await asyncio.sleep(15)
            c = self.counts()
            rss = self.timeline[-1][1] if self.timeline else 0
            kv = self.timeline[-1][2:4] if self.timeline else []
            print(f"[{time.perf_counter() - self.t_load:6.0f}s] sent {len(self.outcomes)}: {c['completed']} completed, "
                  f"{c['disconnected']} disconnected, {c['rejected']} bad refused, {c['injected']} injected failures, "
                  f"{c['failed']} OTHER FAILURES; RSS {rss:.0f} MB, KV used (small, large) {kv}, "
                  f"health {self.health['failures']}/{self.health['checks']} failed", flush=True)

    def counts(self, since: float | None = None) -> dict[str, int]:
        c = {k: 0 for k in ("completed", "disconnected", "rejected", "injected", "failed", "not_fired")}
        for o in self.outcomes:
            if since is None or o.t_end >= since:
                c[o.result] += 1
        return c

    async def touch_kv(self) -> dict[str, int]:
        """Write every page of both KV pools once, before the warm-up. The pools are `torch.empty`
        (engines/kv_cache.py): a page costs resident memory the first time it is written, so without
        this the RSS figures would count the pools filling up for the first time (up to
        --kv-memory-gb) as growth. Distinct long prompts of one token each, some sent on to the large
        model, whose pages the prefix cache keeps until the pool is full and evictions begin."""
        async with aiohttp.ClientSession() as http:
            total = per_model(await self.metrics(http), "aiorouter_kv_pages_total")
        page = 16  # EngineConfig.page_size, which `aiorouter serve` does not change
        n_tok = 1000
        n_small = int(1.2 * total["small"] * page / n_tok) + 1
        n_large = int(1.2 * total["large"] * page / n_tok) + 1
        sem = asyncio.Semaphore(4)

        async def one(routing: dict) -> None:
            async with sem:
                await self.client.completions.create(model=MODEL, prompt=self.mix.ids(n_tok, n_tok + 1), max_tokens=1,
                                                     extra_body={"routing": routing})
        # random p=1: the one token is sampled on the small model, then the large one prefills it all
        await asyncio.gather(*([one({"policy": "random", "p": 1.0}) for _ in range(n_large)] +
                               [one({"policy": "single"}) for _ in range(max(0, n_small - n_large))]))
        async with aiohttp.ClientSession() as http:
            m = await self.metrics(http)
        return {k: per_model(m, "aiorouter_kv_pages_cached")[k] + per_model(m, "aiorouter_kv_pages_used")[k]
                for k in total}

    async def run(self) -> dict:
        a = self.args
        loop_tasks_start = await self.loop_tasks()  # idle, before any load
        t0, rss0 = time.perf_counter(), rss_mb(self.proc.pid)
        self.kv_touched = await self.touch_kv()
        print(f"KV pools written once in {time.perf_counter() - t0:.0f}s (pages held now {self.kv_touched}): "
              f"RSS {rss0:.0f} -> {rss_mb(self.proc.pid):.0f} MB", flush=True)
        async with aiohttp.ClientSession() as http:
            done = asyncio.Event()
            self.t_load = time.perf_counter() + a.warmup_s
            watchers = [asyncio.create_task(f(http, done)) for f in (self.watch_health, self.watch)]
            watchers.append(asyncio.create_task(self.progress(done)))
            # warm-up: the same mix, so the first measured minute meets warm caches and allocators
            print(f"warm-up {a.warmup_s:.0f}s, then {a.minutes:g} min of load at concurrency {CONCURRENCY}", flush=True)
            self.stop_at = self.t_load + a.minutes * 60
            load = [asyncio.create_task(self.worker()) for _ in range(CONCURRENCY)]
            load.append(asyncio.create_task(self.bursts(a.burst_every_s, a.burst_n, a.burst_len)))
            await asyncio.sleep(max(0.0, self.t_load - time.perf_counter()))
            rss_start = rss_mb(self.proc.pid)
            await asyncio.sleep(max(0.0, self.stop_at - time.perf_counter()))
            rss_end = rss_mb(self.proc.pid)
            # each loop finishes the request it is in: a wedged server shows here as a timeout
            _, pending = await asyncio.wait(load, timeout=300)
            for t in pending:
                t.cancel()
            drained, t_drain = await self.drain(http)
            done.set()
            await asyncio.gather(*watchers)
            after = await self.metrics(http)
            async with http.post(self.url + "/reset_prefix_cache") as r:
                freed = (await r.json())["pages_freed"]
            flushed = await self.metrics(http)
        await self.client.close()  # its keep-alive connections hold handler tasks on the server
        # the fewest of a few reads 1 s apart: a connection's handler still closing, or the tuner's
        # re-solve, is a task for a moment; a leaked one stays in every read
        loop_tasks_end = None
        for _ in range(6):
            await asyncio.sleep(1.0)
            n = await self.loop_tasks()
            loop_tasks_end = n if loop_tasks_end is None or n is None else min(loop_tasks_end, n)
        return self.report(rss_start, rss_end, (loop_tasks_start, loop_tasks_end), bool(pending), drained,
                           t_drain, after, freed, flushed)

    async def drain(self, http: aiohttp.ClientSession) -> tuple[bool, float]:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 60:
            m = await self.metrics(http)
            if m.get("aiorouter_requests_active") == 0 and m.get("aiorouter_http_in_flight") == 0:
                await asyncio.sleep(0.5)  # the subservers handle their last release messages
                return True, time.perf_counter() - t0
            await asyncio.sleep(0.2)
        return False, time.perf_counter() - t0

    # -- the figures -----------------------------------------------------------------------------
    def windows(self, width_s: float, kinds=("normal",)) -> list[dict]:
        out = []
        n_win = int(np.ceil(self.args.minutes * 60 / width_s))
        for w in range(n_win):
            lo, hi = self.t_load + w * width_s, self.t_load + (w + 1) * width_s
            lat = [o.latency for o in self.outcomes if o.kind in kinds and o.result == "completed" and lo <= o.t_end < hi]
            ttft = [o.ttft for o in self.outcomes if o.kind in kinds and o.result == "completed" and o.ttft
                    and lo <= o.t_end < hi]
            out.append({"start_s": w * width_s, "n": len(lat),
                        "p50_s": round(float(np.percentile(lat, 50)), 3) if lat else None,
                        "p99_s": round(float(np.percentile(lat, 99)), 3) if lat else None,
                        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3) if ttft else None})
        return out

    def rss_minutes(self) -> list[float]:
        """Median RSS of each minute of the measured load."""
        out = []
        for w in range(int(np.ceil(self.args.minutes))):
            xs = [s[1] for s in self.timeline if w * 60 <= s[0] < (w + 1) * 60]
            if xs:
                out.append(round(float(np.median(xs)), 1))
        return out

    def report(self, rss_start, rss_end, loop_tasks, wedged, drained, t_drain, after, freed, flushed) -> dict:
        c = self.counts()
        by_kind: dict[str, dict[str, int]] = {}
        for o in self.outcomes:
            by_kind.setdefault(o.kind, {}).setdefault(o.result, 0)
            by_kind[o.kind][o.result] += 1
        errors = [o.detail for o in self.outcomes if o.result in ("failed", "not_fired")][:30]
        used_after, cached_after = per_model(after, "aiorouter_kv_pages_used"), per_model(after, "aiorouter_kv_pages_cached")
        total = per_model(after, "aiorouter_kv_pages_total")
        used_flush, cached_flush = per_model(flushed, "aiorouter_kv_pages_used"), per_model(flushed, "aiorouter_kv_pages_cached")
        preempt = per_model(after, "aiorouter_kv_preemptions_total")
        rss_min = self.rss_minutes()
        rss_growth = (rss_min[-1] / rss_min[0] - 1) if len(rss_min) >= 2 else None
        tasks = {"running": int(after.get('aiorouter_subserver_tasks{state="running"}', -1)),
                 "stopped": int(after.get('aiorouter_subserver_tasks{state="stopped"}', -1))}
        loop_tasks_start, loop_tasks_end = loop_tasks
        kinds_fired = {k.split(":")[1] for k, v in by_kind.items() if k.startswith("fault:") and v.get("injected")}
        checks = {
            "no failures but the injected ones": c["failed"] == 0,
            "every marked request failed as planned": c["not_fired"] == 0 and kinds_fired == set(EXPECTED),
            "no KV page in use after drain": drained and sum(used_after.values()) == 0,
            "the prefix cache held pages, and gave them all back on flush":
                sum(cached_after.values()) > 0 and sum(cached_flush.values()) == 0 and sum(used_flush.values()) == 0,
            # full: (nearly) every page in use when sampled every 2 s (a request then waits for pages or
            # preempts one); the bursts ask for ~480 pages of the large model's 410
            "the large model's KV pool ran dry in the bursts":
                preempt.get("large", 0) > 0 or self.kv_peak.get("large", 0) >= 0.97 * total.get("large", 1),
            "RSS growth under 5% from the first minute to the last": rss_growth is not None and rss_growth < 0.05,
            "/health answered throughout": self.health["failures"] == 0,
            "no request wedged": not wedged,
            "every subserver task alive": tasks["running"] == 2 and tasks["stopped"] == 0,
            "no event-loop task leaked (idle before the load vs after it)":
                loop_tasks_end is not None and loop_tasks_end <= loop_tasks_start,
        }
        return {
            "machine": machine(), "config": {k: v for k, v in vars(self.args).items() if k != "out"},
            "concurrency": CONCURRENCY, "load_s": self.args.minutes * 60, "warmup_s": self.args.warmup_s,
            "requests_sent": len(self.outcomes), "completed": c["completed"], "disconnected": c["disconnected"],
            "bad_requests_refused": c["rejected"], "failed_injected": c["injected"], "failed_other": c["failed"],
            "faults_not_fired": c["not_fired"], "by_kind": by_kind, "failures": errors,
            "kv_pages_in_use_after_drain": sum(used_after.values()),
            "kv": {"total": total, "held_after_touch": self.kv_touched, "peak_used": self.kv_peak, "preemptions": preempt, "used_after_drain": used_after,
                   "cached_after_drain": cached_after, "pages_freed_by_flush": freed,
                   "used_after_flush": used_flush, "cached_after_flush": cached_flush},
            "drain_s": round(t_drain, 2),
            "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_end, 1), "rss_minute_medians_mb": rss_min,
            "rss_growth": rss_growth,
            "latency_windows": self.windows(60), "burst_latency_windows": self.windows(60, ("burst",)),
            "router_tasks": tasks, "event_loop_tasks": {"start": loop_tasks_start, "end": loop_tasks_end},
            "health": self.health, "checks": checks, "ok": all(checks.values()),
            "latency_10s": self.windows(10),
            "timeline_columns": ["t_s", "rss_mb", "kv_used_small", "kv_used_large", "kv_cached_small",
                                 "kv_cached_large", "active", "loop_tasks"],
            "timeline": self.timeline,
        }


async def main_async(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = out / "soak-fault-plan.json"
    plan.write_text(json.dumps({"markers": MARKERS, "after": AFTER}))
    small, large = tiny_chat_qwen3("small"), tiny_chat_qwen3("large")
    port = free_port()
    log = open(out / "soak-server.log", "w")
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", f"small={small}", "--model", f"large={large}",
           "--policy", "random", "--policy-arg", "p=0.3", "--kv-memory-gb", str(args.kv_memory_gb),
           "--port", str(port), "--inject-faults", str(plan), "--grace", "30"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.update(MALLOC[args.malloc])
    print("server:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url, timeout=600)
        await wait_tuned(url)  # the start-up solve takes CPU and memory: not inside the measured load
        data = await Soak(args, url, proc).run()
        proc.send_signal(signal.SIGTERM)
        data["server_exit_code"] = await asyncio.to_thread(proc.wait, 60)
        data["checks"]["the server stopped cleanly on SIGTERM"] = data["server_exit_code"] == 0
        data["ok"] = all(data["checks"].values())
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    (out / "soak.json").write_text(json.dumps(data, indent=1))
    from bench.plots import soak as plot
    plot(data, out / "soak.png")
    md = write_md(data, out / "soak.json", out / "soak.png")
    print(f"wrote {out / 'soak.json'}, {out / 'soak.png'} and {md}", flush=True)
    print(summary(data), flush=True)
    return 0 if data["ok"] else 1


def _range(d: dict, key: str) -> str:
    xs = [w[key] for w in d["latency_windows"] if w[key] is not None]
    return f"{min(xs):.1f}-{max(xs):.1f}" if xs else "-"


def markdown(d: dict, json_path: Path, png_path: Path | None, md_dir: Path) -> str:
    """The figures and checks of a run, as soak.md (links relative to `md_dir`, its folder)."""
    m, kv = d["machine"], d["kv"]
    load = "/".join(f"{x:.2f}" for x in m.get("load_avg", []))
    rss_min = d["rss_minute_medians_mb"]
    growth = "-" if d["rss_growth"] is None else f"{100 * d['rss_growth']:+.1f}%"
    out = ["# Soak: mixed load with failures on purpose", "",
           f"_Generated by `python -m bench.soak`; raw data: `{rel(json_path)}`._", "",
           f"{d['load_s'] / 60:g} minutes of load after a {d['warmup_s']:g} s warm-up, concurrency {d['concurrency']}, "
           f"commit {m.get('commit', '?')[:10]}, {m.get('cores', '?')} cores, load average at the end {load} "
           f"(other processes share the cores: latencies are this machine's, not the runtime's). Server malloc: "
           f"{d['config'].get('malloc', 'stock')} (bench/soak.py, MALLOC).", "",
           "| figure | value |", "|---|---|",
           f"| requests sent | {d['requests_sent']} |",
           f"| completed | {d['completed']} |",
           f"| disconnected by the client (10% of normal requests) | {d['disconnected']} |",
           f"| bad requests refused (4xx) | {d['bad_requests_refused']} |",
           f"| failed on purpose (injected faults, each with its expected error) | {d['failed_injected']} |",
           f"| **failed otherwise** | **{d['failed_other']}** |",
           f"| KV pages in use after drain (neither a request nor the prefix cache) | {d['kv_pages_in_use_after_drain']} |",
           f"| prefix-cache pages after drain -> freed by `POST /reset_prefix_cache` | "
           f"{kv['cached_after_drain']} -> {kv['pages_freed_by_flush']} (left: {kv['cached_after_flush']}) |",
           f"| KV pages per pool / peak in use / preemptions | {kv['total']} / {kv['peak_used']} / {kv['preemptions']} |",
           f"| RSS at start / end of the load (MB) | {d['rss_start_mb']} / {d['rss_end_mb']} |",
           f"| RSS per-minute medians, first -> last (MB) | {rss_min[0] if rss_min else '-'} -> "
           f"{rss_min[-1] if rss_min else '-'} ({growth}) |",
           f"| /health failures / checks (slowest answer) | {d['health']['failures']} / {d['health']['checks']} "
           f"({d['health']['max_latency_s']} s) |",
           f"| router subserver tasks at the end | {d['router_tasks']} |",
           f"| event-loop tasks, idle before / after | {d['event_loop_tasks']['start']} / {d['event_loop_tasks']['end']} |",
           f"| latency of normal requests, p50 / p99 over one-minute windows (s) | {_range(d, 'p50_s')} / "
           f"{_range(d, 'p99_s')} |"]
    out += ["", "Checks:", ""] + [f"- {'ok' if v else '**FAILED**'}: {k}" for k, v in d["checks"].items()]
    if png_path is not None:
        # a link is read from the page's own folder, not from the repository root
        out += ["", f"![latency, RSS and KV pages over time]({rel(png_path, md_dir)})"]
    return "\n".join(out) + "\n"


def write_md(d: dict, json_path: Path, png_path: Path | None) -> Path:
    md = json_path.with_suffix(".md")
    md.write_text(markdown(d, json_path, png_path, md.parent))
    return md


def summary(d: dict) -> str:
    lines = [f"requests {d['requests_sent']}: {d['completed']} completed, {d['disconnected']} disconnected, "
             f"{d['bad_requests_refused']} bad refused, {d['failed_injected']} failed on purpose, "
             f"{d['failed_other']} failed otherwise, {d['faults_not_fired']} faults not fired",
             f"KV pages in use after drain {d['kv_pages_in_use_after_drain']}; cached after drain "
             f"{d['kv']['cached_after_drain']}, after flush {d['kv']['cached_after_flush']}; preemptions "
             f"{d['kv']['preemptions']}",
             f"RSS {d['rss_start_mb']} -> {d['rss_end_mb']} MB; minute medians {d['rss_minute_medians_mb']}",
             "latency p50/p99 per minute: " + ", ".join(f"{w['p50_s']}/{w['p99_s']}" for w in d["latency_windows"]),
             f"health {d['health']['failures']}/{d['health']['checks']} failed (max {d['health']['max_latency_s']} s); "
             f"router tasks {d['router_tasks']}; loop tasks {d['event_loop_tasks']}"]
    lines += [f"  [{'ok' if v else 'FAILED'}] {k}" for k, v in d["checks"].items()]
    lines += [f"  failure: {e}" for e in d["failures"][:10]]
    return "\n".join(lines)


async def wait_tuned(url: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            async with http.get(url + "/metrics") as r:
                if parse_metrics(await r.text()).get("aiorouter_thresholds_tuned") == 1:
                    return
            await asyncio.sleep(1)
    raise TimeoutError(f"{url}: the threshold solve did not finish in {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="minutes of measured load (after the warm-up)")
    ap.add_argument("--quick", action="store_true", help="2 minutes of load after a 60 s warm-up")
    ap.add_argument("--out", default=str(RESULTS), help="directory for soak.json, soak.png, soak-server.log")
    ap.add_argument("--warmup-s", type=float, default=60.0)
    ap.add_argument("--kv-memory-gb", type=float, default=0.3, help="the server's KV memory (both models)")
    ap.add_argument("--burst-every-s", type=float, default=240.0,
                    help="seconds between long-prompt bursts (the first at half of it)")
    ap.add_argument("--burst-n", type=int, default=8, help="long prompts per burst")
    ap.add_argument("--burst-len", type=int, default=900, help="tokens per long prompt (about)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--malloc", choices=list(MALLOC), default="bounded",
                    help="the server's glibc malloc settings (see MALLOC in this file); the RSS check is for "
                         "leaks, so it runs with 'bounded' unless told; 'stock' shows allocator retention too")
    ap.add_argument("--render", type=Path, default=None, metavar="SOAK_JSON",
                    help="run nothing: write a saved run's soak.md beside it again")
    args = ap.parse_args(argv)
    if args.render is not None:
        png = args.render.with_name("soak.png")
        print(f"wrote {write_md(json.loads(args.render.read_text()), args.render, png if png.is_file() else None)}")
        return 0
    if args.quick:
        # a burst in each minute (at 30 s and 90 s): the first and last minutes' RSS compare like with like
        # 60 s of warm-up: after 20 s, RSS still rose ~+19% in the first minute and +5% in the second
        # (decaying: caches and allocator pools filling, not a steady leak)
        args.minutes, args.warmup_s, args.burst_every_s = 2.0, 60.0, 60.0
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
