"""Shared benchmark plumbing: the cpu-tiny model pair, closed-loop clients, machine facts, results."""
from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# cpu-tiny: random Qwen3 pair whose step latencies differ ~6x, like the paper's 0.6B/32B pair.
TINY_SHAPES = {"small": dict(hidden=256, layers=4, heads=4, kv_heads=2),
               "large": dict(hidden=1024, layers=12, heads=16, kv_heads=4)}


def cache_dir() -> Path:
    return Path(os.environ.get("AIOROUTER_CACHE", Path.home() / ".cache" / "aiorouter"))


def tiny_qwen3(name: str, vocab: int = 4096, seed: int = 0) -> Path:
    """Build (once) and return a random Qwen3 checkpoint of the cpu-tiny pair."""
    s = TINY_SHAPES[name]
    path = cache_dir() / "bench-models" / f"qwen3-h{s['hidden']}-l{s['layers']}-v{vocab}-s{seed}"
    if (path / "config.json").is_file():
        return path
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                                   num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                                   intermediate_size=3 * s["hidden"], vocab_size=vocab, head_dim=64,
                                   max_position_embeddings=8192, tie_word_embeddings=True,
                                   eos_token_id=1, bos_token_id=0)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp)
    tmp.rename(path)
    return path


def tiny_chat_qwen3(name: str, seed: int = 0) -> Path:
    """The cpu-tiny model `name` with SmolLM2's vocabulary (49152) and its tokenizer and chat
    template beside the weights, so text and chat endpoints serve it (as tests/conftest.py's
    tiny_chat_model does for the tests)."""
    import shutil

    from engines.known_models import default_model_path
    path = tiny_qwen3(name, vocab=49152, seed=seed)
    if not (path / "tokenizer.json").is_file():
        names = [f.name for f in default_model_path().iterdir()
                 if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json")]
        for name in sorted(names, key=lambda n: n == "tokenizer.json"):  # the file checked above goes last
            tmp = path / f"{name}.tmp{os.getpid()}"
            shutil.copy2(default_model_path() / name, tmp)
            tmp.rename(path / name)  # whole files only: another process may be reading the directory
    return path


def machine() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "load_avg": os.getloadavg(), "commit": commit, "time": time.strftime("%Y-%m-%d %H:%M:%S")}


@dataclass
class LoopResult:
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    per_model: dict[str, int] = field(default_factory=dict)
    # The loop holds n requests in flight until the first worker finds no prompt left; after that
    # the run drains with fewer (smollm2, N = 8, 2 requests a client: 7.4 in flight on average
    # over the whole run). A steady-state model predicts the window before the drain.
    streamed: int = 0  # tokens streamed so far
    steady_tokens: int = 0  # ... when the drain began
    steady_seconds: float = 0.0  # from the start to the drain
    in_flight_seconds: float = 0.0  # request-seconds in flight over the whole run
    # With a staggered start (closed_loop's `first`), the window also begins late: once every
    # client has finished its first, shortened request, so the clients' requests are at spread
    # phases, as in the stationary closed loop the throughput model describes.
    started: float = 0.0  # perf_counter at the start, to place the models' step spans in the window
    ramp_tokens: int = 0  # tokens streamed when the last client finished its first request
    ramp_seconds: float = 0.0  # ... and when (0: no staggered start)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def window(self) -> tuple[float, float]:
        """(start, end) of the steady window, perf_counter seconds."""
        return self.started + self.ramp_seconds, self.started + (self.steady_seconds or self.seconds)

    @property
    def steady_tok_s(self) -> float:
        seconds = (self.steady_seconds or self.seconds) - self.ramp_seconds
        tokens = (self.steady_tokens if self.steady_seconds else self.tokens) - self.ramp_tokens
        return tokens / seconds if seconds > 0 else self.tok_s

    def summary(self) -> dict:
        q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] if xs else None
        per_user = [n / t for n, t in self._per_request] if getattr(self, "_per_request", None) else []
        return {"tok_s": self.tok_s, "tokens": self.tokens, "seconds": self.seconds,
                "ttft_p50": q(self.ttft, 0.5), "ttft_p90": q(self.ttft, 0.9),
                "e2e_p50": q(self.e2e, 0.5), "e2e_p90": q(self.e2e, 0.9),
                "per_user_tok_s": statistics.median(per_user) if per_user else None,
                "model_fraction": {k: v / max(1, self.tokens) for k, v in self.per_model.items()},
                "steady_tok_s": self.steady_tok_s, "steady_seconds": self.steady_seconds,
                "ramp_seconds": self.ramp_seconds, "window": self.window,
                "mean_in_flight": self.in_flight_seconds / self.seconds if self.seconds else 0.0}


async def closed_loop(send, n: int, prompts: list, total: int, first=None) -> LoopResult:
    """`n` workers; each sends its next prompt as soon as the last answer ends. `send(prompt)`
    is an async iterator of (token_count_increment, model_name) per streamed token.

    `first(k, prompt)`, when given, sends worker k's first request instead (a staggered start: a
    shorter first request for lower k spreads the clients' phases). Started together with equal
    lengths, the clients stay in step: every prompt of a cohort is prefilled at once, and a model
    waits on the other's burst (smollm2, N = 16, 96-token prompts: the large model idled the first
    1.7 s of a 27 s window while the small one prefilled all 16). The steady window then starts
    when every client has finished its first request (`LoopResult.window`)."""
    res, it = LoopResult(), iter(range(total))
    res._per_request = []
    firsts_left = n if first is not None else 0

    async def worker(k: int):
        nonlocal firsts_left
        for j, i in enumerate(it):
            t0 = time.perf_counter()
            first_tok, n_tok = None, 0
            staggered = first is not None and j == 0
            stream = (first(k, prompts[i % len(prompts)]) if staggered else send(prompts[i % len(prompts)]))
            async for model in stream:
                if first_tok is None:
                    first_tok = time.perf_counter() - t0
                n_tok += 1
                res.streamed += 1
                res.per_model[model] = res.per_model.get(model, 0) + 1
            dt = time.perf_counter() - t0
            res.tokens += n_tok
            res.in_flight_seconds += dt
            res.ttft.append(first_tok or dt)
            res.e2e.append(dt)
            res._per_request.append((n_tok, dt))
            if staggered:
                firsts_left -= 1
                if firsts_left == 0:  # every client is past its staggered first request
                    res.ramp_seconds, res.ramp_tokens = time.perf_counter() - start, res.streamed
        if not res.steady_seconds:  # the first worker out of prompts: the drain begins
            res.steady_seconds, res.steady_tokens = time.perf_counter() - start, res.streamed

    start = res.started = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(n)))
    res.seconds = time.perf_counter() - start
    if res.ramp_seconds >= res.steady_seconds:  # the drain began before the ramp ended: no window
        res.ramp_seconds, res.ramp_tokens = 0.0, 0
    return res


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_healthy(url: str, timeout: float = 300, interval: float = 0.5) -> None:
    """Poll an `aiorouter serve` endpoint's /health until it answers 200 (503 while models load)."""
    import aiohttp
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(interval)
    raise TimeoutError(f"{url} never became healthy")


def rotated(items: list, k: int) -> list:
    """items starting at index k % len(items), wrapping round: round k of a rotating order
    (the benchmarks' schedules take turns in it, so drift reaches each alike)."""
    k = k % len(items) if items else 0
    return items[k:] + items[:k]


def write_json(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **data}, indent=2, default=str))
    return path


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process so far (0 once it is gone)."""
    try:
        fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class OutsideLoad:
    """CPU used by *other* processes while a block runs, in cores (0 = the machine was ours).
    The load average cannot tell: it counts this benchmark's own threads too. `pids`: processes
    the block started (a system's server processes), whose CPU counts as the block's own."""

    def __init__(self, pids: tuple[int, ...] = ()) -> None:
        self.cores: float | None = None
        self.pids = pids

    @staticmethod
    def _machine_busy_s() -> float | None:
        try:
            f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = f[3] + (f[4] if len(f) > 4 else 0)
        return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def _self_s(self) -> float:
        import resource
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime + sum(process_cpu_s(p) for p in self.pids)

    def __enter__(self) -> "OutsideLoad":
        self._t, self._m, self._s = time.perf_counter(), self._machine_busy_s(), self._self_s()
        return self

    def __exit__(self, *exc) -> None:
        m = self._machine_busy_s()
        if m is None or self._m is None:
            return
        wall = time.perf_counter() - self._t
        self.cores = max(0.0, ((m - self._m) - (self._self_s() - self._s)) / wall) if wall > 0 else None
