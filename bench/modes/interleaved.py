"""`bench.modes`: the schedules measured in turn on one warm router under one
stationary closed loop, instead of one router and one closed loop a run.

Why: separate runs of one schedule differed by 10-30 % on the 2-core VMs (cpu-tiny, N = 8, eager:
94 / 111 / 91 tok/s in three ~14 s runs; smollm2 N = 1, where sync, eager and delayed run the same
steps: 11.3-12.6 tok/s), against ~5 % between 3 s windows of a plain matmul loop. A run carries
its own router start, warm-up, staggered ramp and drain, and only a few request lifetimes of
steady window; its speed is the machine's over that minute. Here N clients run without a break
while the router's schedule (`Router.set_schedule`) changes under them: each schedule gets a
settle period, then a measured window, and the schedules take turns in rotating order for
`cycles` rounds, so drift hits every schedule alike and each schedule's figure pools many
windows. A window's record has the keys of a `bench.modes` run, so the same model fits, summaries
and reports read it.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable

import numpy as np

from aiorouter import Router
from aiorouter.metrics import SPANS_KEPT
from bench.common import tokens_computed


class SteadyLoop:
    """N clients in a closed loop on `router`, each sending its next prompt when its last answer
    ends, until the context exits. Client k's first request has first_tokens(k) tokens (a
    staggered start spreads their phases); `ramped` is set once every client is past it.

    Request i's prompt is prompt_at(i), a new one every request: a loop that cycled through 64
    prompts hit the prefix cache from its 65th request on, and its windows' throughput jumped
    from ~85 to ~130 tok/s (cpu-tiny, N = 4, eager; tokens computed per token streamed 2.5 -> 1.05),
    a change of workload in mid-run that separate cold runs never see. `measure(prompts=...)`
    restarts the numbering on another list, so that windows can serve the same prompts (on a router
    without prefix caching, so a prompt served twice is computed twice)."""

    def __init__(self, router: Router, n: int, prompt_at: Callable[[int], list[int]], tokens: int, first_tokens=None):
        self.router, self.n, self.prompt_at, self.tokens = router, n, prompt_at, tokens
        self.first_tokens = first_tokens or (lambda k: tokens)
        self.streamed = 0  # tokens streamed to the clients so far
        self.active, self.in_flight_seconds, self._since = 0, 0.0, 0.0  # requests in flight, integrated
        self.ramped = asyncio.Event()
        self.finished = 0  # requests answered so far
        self.lifetimes: deque[float] = deque(maxlen=2 * n)  # seconds, the last 2N full-length requests'
        self._finish = asyncio.Condition()
        self._firsts_left = n
        self._tasks: list[asyncio.Task] = []
        self._next = 0

    def _flight(self, delta: int) -> None:
        now = time.perf_counter()
        self.in_flight_seconds += self.active * (now - self._since)
        self.active, self._since = self.active + delta, now

    async def _client(self, k: int) -> None:
        first = True
        while True:
            prompt = self.prompt_at(self._next)
            self._next += 1
            max_tokens = self.first_tokens(k) if first else self.tokens
            self._flight(+1)
            t0 = time.perf_counter()
            try:
                async for _ in self.router.stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                    self.streamed += 1
            finally:
                self._flight(-1)
            self.finished += 1
            if not first:
                self.lifetimes.append(time.perf_counter() - t0)
            async with self._finish:
                self._finish.notify_all()
            if first:
                first = False
                self._firsts_left -= 1
                if self._firsts_left == 0:
                    self.ramped.set()

    async def __aenter__(self) -> "SteadyLoop":
        self._since = time.perf_counter()
        self._tasks = [asyncio.create_task(self._client(k)) for k in range(self.n)]
        return self

    async def __aexit__(self, *exc) -> None:
        for t in self._tasks:
            t.cancel()  # the router aborts a cancelled stream's request and frees its pages
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def next_finish(self) -> None:
        """Until the next request is answered; raises what a client died of (never waits on none)."""
        async with self._finish:
            while True:
                try:
                    return await asyncio.wait_for(self._finish.wait(), 5.0)
                except asyncio.TimeoutError:
                    self.check()

    def check(self) -> None:
        """Raise the error a client died of: a window never goes on without one of its clients."""
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise RuntimeError(f"a closed-loop client died: {t.exception()!r}") from t.exception()

    def flight_now(self) -> float:
        """Request-seconds in flight so far, up to now."""
        return self.in_flight_seconds + self.active * (time.perf_counter() - self._since)

    def lifetime(self) -> float:
        """Mean seconds of a request's life lately (0 before any full-length one ended)."""
        return sum(self.lifetimes) / len(self.lifetimes) if self.lifetimes else 0.0

    def restart_prompts(self, prompt_at: Callable[[int], list[int]]) -> None:
        """The clients' next requests ask prompt_at(0), prompt_at(1), ...; requests in flight keep theirs."""
        self.prompt_at, self._next = prompt_at, 0

    async def measure(self, schedule: str, thresholds: dict[str, int], settle: float, window: float,
                      settle_lives: float = 0.0, window_lives: float = 0.0, window_requests: int = 1,
                      prompts: Callable[[int], list[int]] | None = None) -> dict:
        """Switch the router to `schedule`, let the loop settle under it, then measure at least
        `window` seconds, from one answered request to another: one record with the keys of a
        `bench.modes` run (tok_s, routing, spans, ...). A window cut at arbitrary instants reads
        however much of a request's prefill it happened to hold: at N = 1 (cpu-tiny, where sync,
        eager and delayed run the same steps) 2 s windows read 49.7-60.7 tok/s.

        Both periods are also at least `settle_lives` and `window_lives` request lifetimes: delayed
        batching with a high threshold moves requests in cohorts, which start (and prefill) in
        bursts; a window shorter than a life holds one burst or two (cpu-tiny, N = 16, B = (4, 12),
        5 s windows: 89.5-161.5 tok/s; N = 8, B = (2, 7): its windows computed 2.24 tokens on the
        large model per token streamed, sync's and eager's 2.58), and the schedule change itself
        takes about a life to re-form them. And it holds at least `window_requests` answers: how
        much of a request the large model writes depends on its prompt, and at N = 1 windows of about
        two requests read 13.2-18.6 tok/s for what is one schedule there (smollm2).

        `prompts`: the requests sent from the end of the settle on ask prompts(0), prompts(1), ...
        (`restart_prompts`), so windows given one list serve the same requests in the same order
        (at N = 1 exactly: the window opens on the answer before prompts(0) is sent). How much of a
        request the large model writes depends on its prompt: smollm2's N = 1 windows of six
        requests each, all three schedules one there, read 14.5-17.8 tok/s with a new prompt each."""
        r = self.router
        r.set_schedule(schedule, thresholds)
        await asyncio.sleep(max(settle, settle_lives * self.lifetime()))
        self.check()
        if prompts is not None:
            self.restart_prompts(prompts)
        await self.next_finish()
        reset_window(r)
        t0, s0, f0, c0 = time.perf_counter(), self.streamed, self.flight_now(), tokens_computed(r)
        f_start = self.finished
        await asyncio.sleep(max(window, window_lives * self.lifetime()))
        await self.next_finish()
        while self.finished - f_start < window_requests:
            await self.next_finish()
        t1, s1, f1, c1 = time.perf_counter(), self.streamed, self.flight_now(), tokens_computed(r)
        self.check()
        out = window_record(r, t1 - t0, s1 - s0, {k: c1[k] - c0[k] for k in c1}, (t0, t1))
        out.update(mean_in_flight=(f1 - f0) / (t1 - t0), requests=self.finished - f_start, schedule=schedule,
                   thresholds=dict(thresholds) if schedule == "delayed" else None)
        return out


def window_steps(spans: list, window: tuple[float, float]) -> tuple[int, int] | None:
    """(request-steps, tokens computed) of the steps that started inside the window; None when
    the spans kept (the last SPANS_KEPT a model) no longer reach back to its start."""
    if len(spans) >= SPANS_KEPT and spans[0][0] > window[0]:
        return None
    inside = [x for x in spans if window[0] <= x[0] < window[1]]
    return sum(x[2] for x in inside), sum(x[3] for x in inside)


def reset_window(r: Router) -> None:
    """Zero what the router's metrics counted so far, so that they describe the next window only."""
    for m in r.metrics.models.values():
        m.steps, m.step_time_sum = 0, 0.0
        m.loop_time_sum, m.hop_time_sum, m.timed_steps = 0.0, 0.0, 0
        m.batch_sizes.clear()
        m.spans.clear()
    r.metrics.handoffs.clear()


def window_record(r: Router, seconds: float, tokens: int, computed: dict[str, int], window: tuple[float, float]) -> dict:
    """What a window measured, from the metrics counted since `reset_window`."""
    models = r.metrics.models
    spans = {k: [tuple(x) for x in m.spans] for k, m in models.items()}
    inside = {k: window_steps(v, window) for k, v in spans.items()}
    return {"tok_s": tokens / seconds, "steady_tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
            "tokens_computed": computed,
            "handoffs": {f"{a}->{b}": c for (a, b), c in r.metrics.handoffs.items()},
            "request_steps": {k: sum(b * c for b, c in m.batch_sizes.items()) for k, m in models.items()},
            "steps": {k: m.steps for k, m in models.items()},
            "step_time_sum": {k: m.step_time_sum for k, m in models.items()},
            "overhead_ms": {k: {"loop": 1e3 * m.mean_overhead[0], "hop": 1e3 * m.mean_overhead[1],
                                "steps": m.timed_steps} for k, m in models.items()},
            "spans": spans, "window_steps": inside}


def pooled(windows: list[dict]) -> dict:
    """One schedule's windows as one run: tokens over seconds, counts summed, costs step-weighted;
    `rounds_tok_s` keeps each window's figure (one a cycle, in cycle order)."""
    names = list(windows[0]["steps"])
    secs = sum(w["seconds"] for w in windows)
    total = lambda key, k: sum(w[key][k] for w in windows)  # noqa: E731
    steps = {k: total("steps", k) for k in names}
    overhead = {}
    for k in names:
        n = sum(w["overhead_ms"][k]["steps"] for w in windows)
        overhead[k] = {part: (sum(w["overhead_ms"][k][part] * w["overhead_ms"][k]["steps"] for w in windows) / n
                              if n else 0.0) for part in ("loop", "hop")}
        overhead[k]["steps"] = n
    inside = {k: (None if any(w["window_steps"][k] is None for w in windows) else
                  tuple(np.sum([w["window_steps"][k] for w in windows], axis=0).tolist())) for k in names}
    handoffs: dict[str, int] = {}
    for w in windows:
        for key, c in w["handoffs"].items():
            handoffs[key] = handoffs.get(key, 0) + c
    tok_s = sum(w["tokens"] for w in windows) / secs
    return {"tok_s": tok_s, "steady_tok_s": tok_s, "seconds": secs, "windows": len(windows),
            "requests": sum(w["requests"] for w in windows),
            "rounds_tok_s": [w["tok_s"] for w in windows], "rounds_steady_tok_s": [w["tok_s"] for w in windows],
            "mean_in_flight": sum(w["mean_in_flight"] * w["seconds"] for w in windows) / secs,
            "tokens_computed": {k: total("tokens_computed", k) for k in names}, "handoffs": handoffs,
            "request_steps": {k: total("request_steps", k) for k in names},
            "mean_batch": {k: total("request_steps", k) / max(1, steps[k]) for k in names},
            "step_ms": {k: 1e3 * total("step_time_sum", k) / max(1, steps[k]) for k in names},
            "busy": {k: total("step_time_sum", k) / secs for k in names},
            "overhead_ms": overhead, "window_steps": inside,
            "spans": {k: [x for w in windows for x in w["spans"][k]] for k in names},
            "schedule": windows[0]["schedule"], "thresholds": windows[0]["thresholds"]}


def cycle_reference(windows: dict[str, list[dict]], keys: tuple[str, ...] = ("sync", "eager")) -> dict[int, float]:
    """{cycle: geometric mean of `keys`' windows' tok/s in that cycle}: how fast the machine and that
    cycle's prompts ran, from schedules measured in every cycle (the sweep's points are measured in
    some); windows carry their cycle as "cycle". Cycles missing one of `keys` are left out."""
    by: dict[int, list[float]] = {}
    for k in keys:
        for w in windows.get(k, []):
            by.setdefault(w["cycle"], []).append(w["tok_s"])
    return {c: float(np.exp(np.mean(np.log(v)))) for c, v in by.items() if len(v) == len(keys)}


def blocked(windows: list[dict], ref: dict[int, float]) -> float:
    """tok/s of one schedule from its windows, each read against its cycle's reference
    (`cycle_reference`) and put back on the mean reference level: a randomized block design, the
    cycle as the block. Why: windows of the schedules compared are measured in different cycles
    (the sweep in some, its contenders again at the end), and pooled tokens over seconds read a slow
    stretch of the machine as a slow schedule: smollm2, N = 8, 2026-12-03, the confirm cycles ran
    the large model's forwards at 1.6-1.8x the start-up profile against 1.2-1.5x in the cycles
    before: the five contenders' windows there read 104-132 tok/s against 118-144 before, and the
    measured best became (1, 6), a point never measured again. Windows of cycles without a
    reference are left out."""
    level = float(np.mean(list(ref.values())))
    rel = [w["tok_s"] / ref[w["cycle"]] for w in windows if w["cycle"] in ref]
    return level * float(np.mean(rel)) if rel else float("nan")


def race_order(a: str, b: str, pairs: int) -> list[str]:
    """The windows of a race between schedules a and b: pairs in a, b / b, a turn (ABBA), so a
    drift that is linear over two pairs reaches both alike."""
    return [x for i in range(pairs) for x in ((a, b) if i % 2 == 0 else (b, a))]


def race_read(a: list[float], b: list[float]) -> dict:
    """Two schedules raced window by window (`race_order`; window i of each served pair i's prompts):
    the geometric mean of a / b over the pairs and its standard error (of the mean log ratio,
    sd / sqrt(pairs)). Why a race: the sweep's points are each a handful of windows, and one
    window of a delayed schedule reads within ~7 % of the next (smollm2, 2026-12-03: adjacent
    windows' log ratio RMS 0.07-0.11, hardly more for windows a cycle apart, 0.09-0.15), so a
    point's mean over six windows has a ~4 % standard error, and the measured best of four such
    points leads the chain's pick by 5 % as often as not: N = 4, (1, 3) over (1, 2) by +6.0 / +5.0
    / -1.3 / -9.0 / +1.8 / -3.3 % in six runs. The race's pairs are fresh data, not the windows
    that picked its two schedules, so the one that reads higher is not the luckier by selection."""
    if len(a) != len(b) or not a:
        raise ValueError(f"a race reads pairs of windows, got {len(a)} and {len(b)}")
    logs = np.log(np.asarray(a, dtype=float) / np.asarray(b, dtype=float))
    se = float(logs.std(ddof=1) / np.sqrt(len(logs))) if len(logs) > 1 else float("nan")
    return {"ratio": float(np.exp(logs.mean())), "log_se": se, "pairs": len(logs)}
