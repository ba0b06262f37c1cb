"""std-serving-http: one model's `EngineServer` (bench/std_serving.py) in its own process behind HTTP,
as the paper's Std. Serving runs one SGLang server per model; and the client the dispatcher uses.

    python -m bench.token_server --name small --model sim:6.0 --port 8101 [--threads 1] [--page-size 16]
    python -m bench.token_server --name large --model /path/to/checkpoint --port 8102 --threads 2

The protocol is SGLang's native `/generate` with `input_ids`, minus what a per-token dispatcher does
not need (text, sampling options: greedy, one token). Ids travel as raw int32 rather than JSON:
encoding and parsing 8k ids as JSON costs about a millisecond a side, which would slow the baseline.

    POST /generate?logits=0|1&hidden=0|1   body: the whole sequence so far, int32 little-endian
      -> 200 application/octet-stream: the logits (float32 [vocab]) then the hidden state (float32
         [hidden]), each only when asked for; header X-Token: the sampled token
    GET /health · GET /info · GET /stats (phase times) · POST /reset (idle only: flush the prefix
    cache and zero the stats, between benchmark runs)

The dispatcher keeps one keep-alive connection pool per server (`HttpTokenServer`).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.std_serving import EngineServer, TokenReply

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ServerSpec:
    """How to start one model's server process. `model`: a checkpoint directory, or
    sim:LATENCY_MS[:SLOPE_MS] for a weightless `SimEngine` (the `aiorouter serve --model` syntax)."""

    name: str
    model: str
    threads: int = 1  # intra-op threads of the stepping worker (and OMP_NUM_THREADS of the process)
    page_size: int = 16
    num_kv_tokens: int | None = None  # None: the engine's default for a sim, kv_memory_gb for a checkpoint
    kv_memory_gb: float = 2.0
    max_model_len: int | None = None
    vocab_size: int = 512  # sim only

    def argv(self, port: int) -> list[str]:
        a = ["--name", self.name, "--model", self.model, "--port", str(port), "--threads", str(self.threads),
             "--page-size", str(self.page_size), "--kv-memory-gb", str(self.kv_memory_gb),
             "--vocab-size", str(self.vocab_size)]
        if self.num_kv_tokens is not None:
            a += ["--num-kv-tokens", str(self.num_kv_tokens)]
        if self.max_model_len is not None:
            a += ["--max-model-len", str(self.max_model_len)]
        return a


def build_engine(args: argparse.Namespace):
    from engines import Engine, EngineConfig
    from server.cli import parse_models
    spec = parse_models([f"{args.name}={args.model}"])[args.name]  # a ModelSpec: a path or sim:...
    ecfg = dict(page_size=args.page_size, max_model_len=args.max_model_len)
    if args.num_kv_tokens is not None:
        ecfg["num_kv_tokens"] = args.num_kv_tokens
    spec = replace(spec, engine_config=EngineConfig(**ecfg))
    if spec.engine == "sim":
        return replace(spec, vocab_size=args.vocab_size).build("cpu", args.kv_memory_gb, 1)
    # ids in, ids out: no tokenizer to load (transformers' import alone is seconds of start-up)
    return Engine(spec.path, config=replace(spec.engine_config, num_kv_tokens=spec.kv_tokens(args.kv_memory_gb, 1)),
                  load_tokenizer=False)


# -- the server process ------------------------------------------------------------------------------
class TokenApp:
    def __init__(self, server: EngineServer):
        self.server = server
        eng = server.engine
        self.vocab, self.max_len = eng.model_config.vocab_size, eng.max_model_len
        self.handler_s = 0.0  # summed over requests: the handler's time (the engine server's share included)

    def routes(self, app) -> None:
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/info", self.info)
        app.router.add_get("/stats", self.stats)
        app.router.add_post("/reset", self.reset)

    async def generate(self, request):
        from aiohttp import web
        t0 = time.perf_counter()
        body = await request.read()
        if not body or len(body) % 4:
            return web.json_response({"error": f"the body must be int32 token ids, got {len(body)} bytes"}, status=400)
        arr = np.frombuffer(body, dtype="<i4")
        if len(arr) >= self.max_len:
            return web.json_response({"error": f"{len(arr)} tokens; the context is {self.max_len}"}, status=400)
        if arr.min() < 0 or arr.max() >= self.vocab:
            return web.json_response({"error": f"token ids must be in [0, {self.vocab})"}, status=400)
        q = request.query
        r = await self.server.next_token(arr.tolist(), q.get("logits") == "1", q.get("hidden") == "1")
        parts = [t.float().numpy().tobytes() for t in (r.logits, r.hidden) if t is not None]
        self.handler_s += time.perf_counter() - t0
        return web.Response(body=b"".join(parts), content_type="application/octet-stream",
                            headers={"X-Token": str(r.token)})

    async def health(self, request):
        from aiohttp import web
        return web.json_response({"status": "ok"})

    async def info(self, request):
        from aiohttp import web
        eng = self.server.engine
        return web.json_response({"name": self.server.name, "vocab_size": self.vocab, "max_model_len": self.max_len,
                                  "hidden_size": eng.model_config.hidden_size, "page_size": eng.config.page_size,
                                  "pid": os.getpid()})

    async def stats(self, request):
        from aiohttp import web
        return web.json_response({**self.server.stats(), "handler_s": self.handler_s})

    async def reset(self, request):
        from aiohttp import web
        try:
            freed = self.server.reset()
        except RuntimeError as e:
            return web.json_response({"error": str(e)}, status=409)
        self.handler_s = 0.0
        return web.json_response({"pages_freed": freed})


async def serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    from aiorouter import heap
    engine = await asyncio.to_thread(build_engine, args)
    server = await EngineServer(args.name, engine, args.threads).start()
    app = web.Application(client_max_size=64 * 2**20)
    TokenApp(server).routes(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    heap.FrozenHeap.hold()  # as a router does once started: start-up objects out of the cyclic GC (aiorouter/heap.py)
    logging.getLogger("bench.token_server").info("%s ready on port %d", args.name, args.port)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", required=True)
    ap.add_argument("--model", required=True, help="checkpoint directory, or sim:LATENCY_MS[:SLOPE_MS]")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-kv-tokens", type=int, default=None)
    ap.add_argument("--kv-memory-gb", type=float, default=2.0)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--vocab-size", type=int, default=512, help="sim models only")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from aiorouter import run
    try:
        run(serve(args))
    except KeyboardInterrupt:
        pass
    return 0


# -- the dispatcher's side -----------------------------------------------------------------------------
class HttpTokenServer:
    """A `TokenServer` over HTTP: one keep-alive connection pool to one server process."""

    def __init__(self, name: str, url: str):
        self.name, self.url = name, url
        self._session = None
        self.vocab_size = self.hidden_size = 0

    async def open(self) -> "HttpTokenServer":
        import aiohttp
        # no cap on connections: every in-flight token keeps its own, reused across tokens
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=600))
        info = await self.get("/info")
        self.vocab_size, self.hidden_size = info["vocab_size"], info["hidden_size"]
        return self

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def get(self, path: str) -> dict:
        async with self._session.get(self.url + path) as r:
            r.raise_for_status()
            return await r.json()

    async def reset(self) -> dict:
        async with self._session.post(self.url + "/reset") as r:
            data = await r.json()
            if r.status != 200:
                raise RuntimeError(f"{self.name}: reset refused: {data}")
            return data

    async def next_token(self, ids: list[int], logits: bool, hidden: bool) -> TokenReply:
        import torch
        body = np.asarray(ids, dtype="<i4").tobytes()
        async with self._session.post(f"{self.url}/generate?logits={int(logits)}&hidden={int(hidden)}", data=body,
                                      headers={"Content-Type": "application/octet-stream"}) as r:
            payload = await r.read()
            if r.status != 200:
                raise RuntimeError(f"{self.name}: HTTP {r.status}: {payload[:300]!r}")
            token = int(r.headers["X-Token"])
        vec = torch.frombuffer(bytearray(payload), dtype=torch.float32) if payload else None
        lg = vec[:self.vocab_size] if logits else None
        hd = vec[self.vocab_size if logits else 0:] if hidden else None
        return TokenReply(token, lg, hd)


class ServerProcesses:
    """Start one server process per spec (concurrently), wait until each answers, stop them at exit."""

    def __init__(self, specs: list[ServerSpec], start_timeout_s: float = 600.0):
        self.specs, self.timeout = specs, start_timeout_s
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.clients: list[HttpTokenServer] = []

    async def __aenter__(self) -> "ServerProcesses":
        from bench.common import free_port
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        try:
            for spec in self.specs:
                port = free_port()
                log = Path(tempfile.mkstemp(prefix=f"token-server-{spec.name}-", suffix=".log")[1])
                self.logs.append(log)
                with open(log, "w") as f:
                    self.procs.append(subprocess.Popen(
                        [sys.executable, "-m", "bench.token_server", *spec.argv(port)], cwd=ROOT, stdout=f,
                        stderr=subprocess.STDOUT, env={**env, "OMP_NUM_THREADS": str(spec.threads)}))
                self.clients.append(HttpTokenServer(spec.name, f"http://127.0.0.1:{port}"))
            await asyncio.gather(*(self._wait(i) for i in range(len(self.specs))))
            for c in self.clients:
                await c.open()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _wait(self, i: int) -> None:
        import aiohttp
        deadline = time.monotonic() + self.timeout
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                if self.procs[i].poll() is not None:
                    tail = self.logs[i].read_text()[-2000:]
                    raise RuntimeError(f"server {self.specs[i].name!r} exited ({self.procs[i].returncode}):\n{tail}")
                try:
                    async with s.get(self.clients[i].url + "/health") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        raise TimeoutError(f"server {self.specs[i].name!r} did not answer within {self.timeout:.0f} s")

    async def __aexit__(self, *exc) -> None:
        for c in self.clients:
            await c.close()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                await asyncio.to_thread(p.wait, 30)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in self.logs:
            log.unlink(missing_ok=True)

    async def stats(self) -> dict[str, dict]:
        return {c.name: await c.get("/stats") for c in self.clients}

    async def reset(self) -> None:
        for c in self.clients:
            await c.reset()


if __name__ == "__main__":
    raise SystemExit(main())
