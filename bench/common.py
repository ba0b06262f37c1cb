"""Shared benchmark plumbing: the model pairs, closed-loop clients, machine facts, results, arguments."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
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


# -- the real pairs ---------------------------------------------------------------------------------
PAIRS = ("cpu-tiny", "smollm2")


@dataclass
class Pair:
    name: str
    small: Path
    large: Path
    policy: str
    policy_args: dict
    vocab: int
    notes: dict = field(default_factory=dict)


def pair_paths(name: str) -> tuple[Path, Path]:
    """(small, large) checkpoints: cpu-tiny's random Qwen3s, or SmolLM2-135M's first 10 layers and all 30."""
    if name == "cpu-tiny":
        return tiny_qwen3("small"), tiny_qwen3("large")
    if name == "smollm2":
        from engines.default_model import truncated_model_path
        from engines.known_models import default_model_path
        large = default_model_path()
        return truncated_model_path(large, 10), large
    raise ValueError(f"unknown pair {name!r}; choose from {', '.join(PAIRS)}")


def load_pair(name: str) -> Pair:
    """A pair with its policy: cpu-tiny routes `random` p = 0.35; smollm2 `rstitch` at the tau where it
    splits its tokens alike (`calibrate`, on prompts drawn like low-effort's but not the measured ones)."""
    small, large = pair_paths(name)
    if name == "cpu-tiny":
        return Pair(name, small, large, "random", {"p": 0.35, "seed": 7}, 4096)
    from bench import workloads as W
    vocab = json.loads((large / "config.json").read_text())["vocab_size"]
    cal = calibrate(small, large, W.short_prompts(seed=123, count=4, vocab=min(vocab, W.VOCAB)),
                    cache=cache_dir() / "bench-tau")
    return Pair(name, small, large, "rstitch", {"tau": cal["tau"]}, vocab, {"tau_calibration": cal})


# rstitch's tau for a real pair. With a fixed tau (the policy's default 0.03) the smollm2 pair never
# routes: the 10-layer small model is unsure of every token on these prompts, and the large model of
# nearly every one, so each token costs a small step and a large step. Here both models decode a few
# prompts greedily, their normalised entropies are recorded, and tau is the value at which rstitch's
# two-state chain (small hands off when H_small > tau, large hands back when H_large <= tau) spends
# `target` of its steps on the large model, as `random` does on cpu-tiny (p = 0.35).
def entropies(path: str | Path, prompts: list[list[int]], steps: int) -> np.ndarray:
    """Normalised next-token entropies along each prompt's greedy continuation."""
    from engines import Engine, SamplingParams
    from policies.rstitch import normalized_entropy
    eng = Engine.from_pretrained(path, num_kv_tokens=4096)
    out: list[float] = []
    seqs = [eng.add_request(p, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)) for p in prompts]
    with torch.inference_mode():
        while not all(s.is_finished for s in seqs):
            step = eng.forward()
            out += normalized_entropy(step.logits).tolist()
            for s, t in zip(step.seqs, step.next_tokens):
                eng.append_token(s, t)
    return np.asarray(out)


def large_share(tau: float, h_small: np.ndarray, h_large: np.ndarray) -> float:
    """Stationary share of large-model steps: p / (p + q), p = P(H_small > tau), q = P(H_large <= tau)."""
    p, q = float((h_small > tau).mean()), float((h_large <= tau).mean())
    return p / (p + q) if p + q > 0 else 0.0


def calibrate(small: str | Path, large: str | Path, prompts: list[list[int]], target: float = 0.35,
              steps: int = 32, cache: Path | None = None) -> dict:
    """-> {"tau", "large_share" (predicted), "target", "tokens"}: the candidate closest to the target.
    With `cache` (a folder), a result is kept there under a hash of both checkpoints' files (names,
    sizes, mtimes) and every argument, and reused: the calibration decodes with both models."""
    entry = None
    if cache is not None:
        files = [sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(p).iterdir() if f.is_file())
                 for p in (small, large)]
        key = json.dumps([*files, prompts, target, steps])
        entry = Path(cache) / f"tau-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
        if entry.is_file():
            return json.loads(entry.read_text())
    h_small, h_large = entropies(small, prompts, steps), entropies(large, prompts, steps)
    candidates = np.unique(np.concatenate([h_small, h_large]))
    shares = np.array([large_share(t, h_small, h_large) for t in candidates])
    best = int(np.argmin(np.abs(shares - target)))
    out = {"tau": round(float(candidates[best]), 6), "large_share": round(float(shares[best]), 3),
           "target": target, "tokens": int(h_small.size)}
    if entry is not None:
        write_atomic(entry, json.dumps(out))
    return out


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def machine() -> dict:
    """What every result file records of where it ran: the CPU (and whether it has AVX512-BF16 and
    AMX), cores, versions, load, the commit (and whether the code differed from it), the time."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())  # the first CPU's
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    return {"cpu": info.get("model name") or platform.processor(), "cores": os.cpu_count(),
            "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags, "torch": torch.__version__,
            "python": platform.python_version(), "load_avg": os.getloadavg(), "commit": _git("rev-parse", "HEAD"),
            "uncommitted": bool(_git("status", "--porcelain", "--", "aiorouter", "engines", "policies", "bench")),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


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


def tokens_computed(r) -> dict[str, int]:
    """Tokens each of a router's models has run through its layers so far (prefill, decode, catch-up extends)."""
    return {s.name: s.engine.stats.num_prefill_tokens + s.engine.stats.num_decode_tokens for s in r.subservers}


async def router_loop(r, prompts: list, n: int, total: int, max_tokens: int, warmup_prompts: list,
                      warmup_tokens: int = 16) -> dict:
    """A started router's throughput under `n` closed-loop clients sending `total` of `prompts`
    (greedy, `max_tokens` each, EOS ignored), once its thresholds are solved and it has served `n`
    warm-up requests at concurrency `n` (first calls of a batch shape, oneDNN primitives and the
    allocator are not what is measured): the loop's summary and the models' counters over the run."""
    async def send(p, max_tokens=max_tokens):
        async for ev in r.stream(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
            yield ev.model

    await r.wait_tuned()  # measure the tuned thresholds, not the B = 1 stand-in used while solving
    await closed_loop(lambda p: send(p, min(warmup_tokens, max_tokens)), n, warmup_prompts, n)
    models = r.metrics.models
    for m in models.values():  # measure the run only
        m.steps, m.step_time_sum, m.admission_delay_sum, m.admission_delay_count = 0, 0.0, 0.0, 0
        m.batch_sizes.clear()
    r.metrics.handoffs.clear()
    before = tokens_computed(r)
    res = await closed_loop(send, n, prompts, total)
    out = res.summary()
    out["tokens_computed"] = {k: v - before[k] for k, v in tokens_computed(r).items()}  # extends included
    out["handoffs"] = sum(r.metrics.handoffs.values())
    out["mean_batch"] = {k: m.mean_batch_size for k, m in models.items()}
    out["steps"] = {k: m.steps for k, m in models.items()}
    out["step_ms"] = {k: 1000 * m.step_time_sum / max(1, m.steps) for k, m in models.items()}
    out["busy"] = {k: m.step_time_sum / res.seconds for k, m in models.items()}  # share of the run inside steps
    out["admission_delay_ms"] = {k: 1000 * m.mean_admission_delay for k, m in models.items()}
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_healthy(url: str, timeout: float = 300, interval: float = 0.5, proc=None, log: Path | None = None) -> None:
    """Poll a server's /health until it answers 200 (`aiorouter serve` answers 503 while models load);
    with `proc` (a Popen), fail at once if it exits, quoting the end of its `log`."""
    import aiohttp
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                tail = log.read_text()[-2000:] if log is not None else ""
                raise RuntimeError(f"{url}: the server exited ({proc.returncode}):\n{tail}")
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


def write_json(name: str, data: dict, out: Path = RESULTS) -> Path:
    """`out`/`name`.json: `data` with the machine's facts."""
    path = Path(out) / f"{name}.json"
    write_atomic(path, json.dumps({"machine": machine(), **data}, indent=2, default=str))
    return path


def write_atomic(path: Path, text: str) -> None:
    """Write `path` whole: a reader (or a crash mid-write) sees the last complete file or this one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def rel(path: Path, base: Path = ROOT) -> str:
    """`path` relative to `base` (the repository) where it lies below it, for links and citations."""
    path, base = Path(path).resolve(), Path(base).resolve()
    return str(path.relative_to(base)) if path.is_relative_to(base) else str(path)


def commas(text: str, conv=str, allowed=None) -> list:
    """A comma list from the command line, each item through `conv`; exits naming an item not in `allowed`."""
    items = [conv(x.strip()) for x in text.split(",") if x.strip()]
    bad = [x for x in items if allowed is not None and x not in allowed]
    if bad:
        raise SystemExit(f"unknown {bad[0]!r}; choose from {', '.join(map(str, allowed))}")
    return items


def subcommands(argv: list[str] | None, default, **commands) -> int:
    """`python -m bench.X [COMMAND] ...`: the named command's main on the rest, else `default`'s on all."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in commands:
        return commands[argv[0]](argv[1:])
    return default(argv)


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
