"""aiorouter on Ray Serve: N replicas, each one `Router`, behind one OpenAI-compatible endpoint.

    client -> Serve proxy -> Ingress (no CPU) -> RouterReplica x N -> server/app.py's aiohttp app

The routes exist once, in server/app.py: a replica runs that aiohttp app on a private unix socket
and forwards raw HTTP to it, so validation, auth, SSE and /metrics behave as in `aiorouter serve`.
The ingress is there because Serve does not re-send a request once a replica has accepted it: when
a replica dies, the ingress re-sends every request that had not yet sent a body byte to its client
and ends the streams already under way with an SSE error event.

Only this module (and its test) imports Ray, and only inside functions: importing it without the
`ray` extra works, and `aiorouter serve --ray` then says what to install.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
from dataclasses import replace
from typing import Any, AsyncIterator, Mapping

from aiorouter.config import RouterConfig
from aiorouter.spec import ModelSpec
from engines.devices import parse_devices
from server.app import ServerConfig

log = logging.getLogger("aiorouter.ray")

APP = "aiorouter"
INSTALL = "pip install 'aiorouter[ray]'"
REQUEST_HEADERS = ("content-type", "authorization", "accept")
RESPONSE_HEADERS = ("content-type", "cache-control", "retry-after", "x-aiorouter-ignored-fields")
REPLICA_HEADER = "x-aiorouter-replica"  # the Ray actor name of the replica that answered


def require_ray(loopback: bool = False):
    """Import Ray Serve, or fail with the command that installs it. `loopback`: a Ray cluster this
    process starts stays on 127.0.0.1 (Ray's single-machine mode, read when ray is imported)."""
    if loopback:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise SystemExit(f"aiorouter serve --ray needs Ray Serve ({e}); install it with: {INSTALL}") from None
    return ray, serve


# -- resources -------------------------------------------------------------------------------------
def _gpu_ids(device: str) -> list[int]:
    return [d.index or 0 for d in parse_devices(device) if d.type == "cuda"]


def replica_resources(models: Mapping[str, Any], device: str = "cpu",
                      num_cpus: float | None = None) -> tuple[dict[str, float], dict[str, ModelSpec], str]:
    """Ray resources for one replica, and the model specs and router device as the replica sees them.

    Ray hands a replica its GPUs as cuda:0..k-1 (it sets CUDA_VISIBLE_DEVICES), so a spec on
    "cuda:2,3" becomes "cuda:0,1" inside the replica; what Ray reserves is the number of distinct
    devices. A CPU model steps in a worker thread of its own, hence a core per model by default; a
    simulated model only sleeps and asks for none."""
    specs = {name: ModelSpec.coerce(v) for name, v in models.items()}
    placed = {name: s.device or device for name, s in specs.items()}
    gpus = sorted({g for d in [*placed.values(), device] for g in _gpu_ids(d)})
    local = {g: i for i, g in enumerate(gpus)}

    def remap(d: str) -> str:
        ids = _gpu_ids(d)
        return "cuda:" + ",".join(str(local[g]) for g in ids) if ids else d

    specs = {name: replace(s, device=remap(placed[name])) for name, s in specs.items()}
    if num_cpus is None:
        num_cpus = 1.0 if gpus else float(sum(s.engine == "real" for s in specs.values()))
    opts: dict[str, float] = {"num_cpus": num_cpus}
    if gpus:
        opts["num_gpus"] = float(len(gpus))
    return opts, specs, remap(device)


# -- the replica -------------------------------------------------------------------------------------
class RouterReplica:
    """One Serve replica: a Router and server/app.py's `Server` on a unix socket only it can reach."""

    async def __init__(self, models: dict[str, Any], router_config: RouterConfig, config: ServerConfig):
        import aiohttp
        import ray
        from aiohttp import web

        from aiorouter import Router
        from server.app import Server
        ctx = ray.get_runtime_context()
        self.name = ctx.get_actor_name() or "local"
        cpus = ctx.get_assigned_resources().get("CPU")
        if router_config.threads is None and cpus and cpus < (os.cpu_count() or 1):
            # the Router plans threads for the whole machine, but this replica shares it: more threads
            # than its cores make OpenMP teams of co-located replicas fight (bench/RESULTS.md, "Replicas")
            router_config = replace(router_config, threads=max(1, int(cpus)))
        self.router = Router(models, router_config)
        self.server = Server(self.router, config)
        self._dir = tempfile.mkdtemp(prefix="aiorouter-")
        sock = os.path.join(self._dir, "http.sock")
        self._runner = web.AppRunner(self.server.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.UnixSite(self._runner, sock).start()
        await self.router.start()
        self.server.ready = True
        # no total timeout: a long stream is normal; limit=0: the Server's own slots bound concurrency
        self._http = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock, limit=0),
                                           timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)

    async def forward(self, method: str, path: str, headers: dict[str, str], body: bytes) -> AsyncIterator[Any]:
        """Yields the response head (status, headers, replica), then body chunks as they come."""
        async with self._http.request(method, "http://replica" + path, headers=headers, data=body) as r:
            yield {"status": r.status, "replica": self.name,
                   "headers": {k: r.headers[k] for k in RESPONSE_HEADERS if k in r.headers}}
            async for chunk in r.content.iter_any():
                yield chunk

    def check_health(self) -> None:
        # a subserver that died restarts in the replica (RouterConfig.max_restarts); one past its restarts
        # leaves the router dead, and Serve replaces the replica
        if self.router.dead:
            raise RuntimeError(f"router is dead: {self.router.dead}")

    async def __del__(self) -> None:
        # Serve calls this once the replica's requests drained (graceful_shutdown_timeout_s), and
        # after a failed __init__ too: hence the getattr guards
        if (http := getattr(self, "_http", None)) is not None:
            await http.close()
        if (router := getattr(self, "router", None)) is not None:
            await router.close()
        if (runner := getattr(self, "_runner", None)) is not None:
            await runner.cleanup()
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)


# -- the ingress -------------------------------------------------------------------------------------
def _error(status: int, message: str, type_: str, headers: dict[str, str] | None = None):
    from starlette.responses import JSONResponse
    body = {"error": {"message": message, "type": type_, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class Ingress:
    """Forwards every HTTP request to a RouterReplica, re-sending it while no body byte went out."""

    def __init__(self, replicas, attempts: int = 3):
        self.replicas = replicas.options(stream=True)
        self.attempts = attempts

    async def __call__(self, request):
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError
        from starlette.responses import StreamingResponse
        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: request.headers[k] for k in REQUEST_HEADERS if k in request.headers}
        for attempt in range(1, self.attempts + 1):
            gen = self.replicas.forward.remote(request.method, path, headers, body)
            try:
                head = await gen.__anext__()
                first = await anext(gen, b"")  # SSE headers go out early; wait for a byte of body
            except RayActorError as e:  # the replica died; the client has seen nothing: re-send
                log.warning("replica died before answering (attempt %d/%d): %s", attempt, self.attempts,
                            str(e).splitlines()[0])
                continue
            except BackPressureError:
                return _error(429, "all replicas are at capacity; retry later", "rate_limit_error",
                              {"Retry-After": "1"})
            except Exception as e:  # the replica raised: nothing to re-send to
                log.exception("replica failed")
                return _error(500, f"replica failed: {str(e).splitlines()[0]}", "server_error")
            if head["status"] == 503 and attempt < self.attempts:  # a draining replica: try another
                gen.cancel()
                continue
            sse = head["headers"].get("content-type", "").startswith("text/event-stream")
            return StreamingResponse(self._rest(gen, first, sse, head["replica"]), status_code=head["status"],
                                     headers={**head["headers"], REPLICA_HEADER: head["replica"]})
        return _error(503, f"no replica answered in {self.attempts} attempts", "unavailable")

    @staticmethod
    async def _rest(gen, first: bytes, sse: bool, replica: str) -> AsyncIterator[bytes]:
        from ray.exceptions import RayActorError
        try:
            if first:
                yield first
            async for chunk in gen:
                yield chunk
        except Exception as e:
            if not sse:
                raise  # half a JSON body cannot be mended: the connection is cut
            msg = (f"replica {replica} died mid-stream; the partial answer cannot be resumed on another "
                   "replica, retry the request") if isinstance(e, RayActorError) else \
                f"replica {replica} failed mid-stream: {str(e).splitlines()[0]}"
            err = {"error": {"message": msg, "type": "server_error", "param": None, "code": 503}}
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            gen.cancel()  # the client went away (or we are done): stop the replica's work


# -- building and running --------------------------------------------------------------------------
def build_app(models: dict[str, Any], router_config: RouterConfig, config: ServerConfig = ServerConfig(),
              replicas: int = 1, num_cpus: float | None = None, grace_s: float = 30.0,
              max_ongoing_requests: int | None = None):
    """The Serve application: `replicas` RouterReplicas, resources taken from the model specs."""
    _, serve = require_ray()
    opts, models, device = replica_resources(models, router_config.device, num_cpus)
    router_config = replace(router_config, device=device)
    backend = serve.deployment(RouterReplica, name="RouterReplica", num_replicas=replicas, ray_actor_options=opts,
                               # Serve queues beyond the router's slots, where a dead replica costs nothing
                               max_ongoing_requests=max_ongoing_requests or config.max_concurrency,
                               max_queued_requests=replicas * config.max_queue,
                               graceful_shutdown_timeout_s=grace_s)
    ingress = serve.deployment(Ingress, name="Ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=100_000)
    return ingress.bind(backend.bind(models, router_config, config))


def serve_ray(args, models: dict[str, Any], router_config: RouterConfig, config: ServerConfig) -> int:
    """`aiorouter serve --ray`: start a local Ray cluster (or join --ray-address) and serve until SIGTERM."""
    own = args.ray_address is None
    ray, serve = require_ray(loopback=own and args.host in ("127.0.0.1", "localhost"))
    stop, started = threading.Event(), threading.Event()

    def on_signal(*_) -> None:
        stop.set()
        if not started.is_set():  # serve.run blocks until every replica is up: abandon the start
            raise KeyboardInterrupt

    ray.init(address="local" if own else args.ray_address, include_dashboard=False)
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs a SIGTERM handler that aborts
        signal.signal(sig, on_signal)
    try:
        num_cpus = None
        need = replica_resources(models, router_config.device)[0]["num_cpus"]
        have = ray.cluster_resources().get("CPU", 1.0)
        if own and need * args.replicas > have:
            # a local cluster cannot grow: the replicas share this machine's cores rather than wait forever
            num_cpus = have / args.replicas
            log.warning("%d replicas want %.1f CPUs each; this machine has %.0f: each gets %.2f",
                        args.replicas, need, have, num_cpus)
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(models, router_config, config, args.replicas, num_cpus, grace_s=args.grace), name=APP,
                  route_prefix="/")
        started.set()
        log.info("ready: http://%s:%d/v1 (%d replicas on Ray Serve, policy %s, mode %s)", args.host, args.port,
                 args.replicas, router_config.policy, router_config.mode)
        stop.wait()
        log.info("shutting down: replicas get %.0fs to finish in-flight requests", args.grace)
        serve.delete(APP)
    except KeyboardInterrupt:
        log.info("interrupted while starting")
    finally:
        if own and ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    log.info("stopped")
    return 0
