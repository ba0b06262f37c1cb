"""Scale-out on one machine: throughput of 1 against 2 aiorouter replicas on Ray Serve, and of one
`aiorouter serve` process without Ray, on the default SmolLM2 pair (CPU, rstitch, eager mode).
Closed-loop streaming clients over loopback HTTP; configurations interleaved over the repeats.

    python bench/ray_replicas.py [--concurrency 16] [--requests 64] [--tokens 64] [--repeats 2]

The replicas of one machine share its cores: 1 replica gets all of them, 2 replicas half each.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp

from aiorouter.cpu_threads import plan_threads
from bench.common import ROOT, OutsideLoad, closed_loop, free_port, wait_healthy, write_json

# eager: the delayed mode's start-up threshold solve would run inside each replica and blur the
# comparison; replicas are independent, so the mode does not change how they scale
ROUTER = {"policy": "rstitch", "mode": "eager", "kv_memory_gb": 1.0, "max_concurrency": 64}
TOPICS = ["rivers", "prime numbers", "the moon", "bread", "volcanoes", "chess", "bees", "glaciers"]


ROLES = (("RouterReplica", "replicas"), ("server.cli", "replicas"), ("Ingress", "ingress"), ("ProxyActor", "proxy"))


def tree_cpu() -> dict[str, float]:
    """CPU seconds used so far by this process ("client") and its descendants, by role."""
    kids: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}  # pid -> /proc/<pid>/stat fields after the command name
    for d in Path("/proc").iterdir():
        try:
            pid, fields = int(d.name), (d / "stat").read_text().rsplit(")", 1)[1].split()
            kids.setdefault(int(fields[1]), []).append(pid)
            stats[pid] = fields
        except (OSError, ValueError, IndexError):
            continue
    out: dict[str, float] = {}
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            fields = stats[pid]
            cmd = Path(f"/proc/{pid}/cmdline").read_text()
        except (KeyError, OSError):
            continue
        role = "client" if pid == os.getpid() else next((r for key, r in ROLES if key in cmd), "ray-other")
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


class TreeLoad(OutsideLoad):
    """OutsideLoad, but this process's descendants (the Ray cluster, the server) count as ours."""

    @staticmethod
    def _self_s() -> float:
        return sum(tree_cpu().values())


def prompts(n: int) -> list[str]:
    return [f"Question {i}: write a few sentences about {TOPICS[i % len(TOPICS)]} for a curious child."
            for i in range(n)]


async def drive(url: str, n: int, total: int, tokens: int) -> dict:
    """Warm up, then `total` requests from `n` closed-loop clients; tokens counted from usage."""
    replicas: dict[str, int] = {}
    async with aiohttp.ClientSession() as s:
        async def send(prompt: str):
            body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                rep = r.headers.get("x-aiorouter-replica", "process")
                replicas[rep] = replicas.get(rep, 0) + 1
                seen = 0
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    d = json.loads(line[6:])
                    if d.get("usage"):  # tokens that streamed no text of their own (partial UTF-8) count too
                        for _ in range(d["usage"]["completion_tokens"] - seen):
                            yield "no-text"
                        continue  # read on to [DONE]: leaving early reads as a client disconnect
                    if d["choices"] and d["choices"][0]["text"]:
                        seen += 1
                        yield d.get("aiorouter", {}).get("model", "?")
        await closed_loop(send, n, prompts(2 * n), 2 * n)  # warm-up: every replica prefills and decodes
        replicas.clear()
        before = tree_cpu()
        with TreeLoad() as load:
            res = await closed_loop(send, n, prompts(total), total)
        after = tree_cpu()
    # CPU milliseconds per output token, by role: what the load balancer costs next to the replicas
    cpu_ms = {k: 1000 * (after[k] - before.get(k, 0.0)) / max(1, res.tokens) for k in after}
    return {**res.summary(), "requests_per_replica": sorted(replicas.values()), "outside_load_cores": load.cores,
            "cpu_ms_per_token": cpu_ms}


def run_process(models: dict, args) -> dict:
    """One `aiorouter serve` process, no Ray: the baseline the replicas are compared with."""
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--policy", ROUTER["policy"],
           "--mode", ROUTER["mode"], "--kv-memory-gb", str(ROUTER["kv_memory_gb"])]
    for name, path in models.items():
        cmd += ["--model", f"{name}={path}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_healthy(url))
        return asyncio.run(drive(url, args.concurrency, args.requests, args.tokens))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run_ray(serve, url: str, models: dict, replicas: int, args, threads: dict | None = None) -> dict:
    from aiorouter import RouterConfig
    from server.app import ServerConfig
    from server.ray_serve import APP, build_app
    cores = os.cpu_count() or 1
    app = build_app(models, RouterConfig(**ROUTER, threads=threads),
                    ServerConfig(max_concurrency=ROUTER["max_concurrency"]), replicas=replicas, num_cpus=cores / replicas)
    serve.run(app, name=APP, route_prefix="/")
    try:
        return asyncio.run(drive(url, args.concurrency, args.requests, args.tokens))
    finally:
        serve.delete(APP)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--configs", default="process,ray-1,ray-2,ray-2-uncapped",
                    help="ray-2-uncapped: 2 replicas, each with the threads the Router plans for the whole machine")
    args = ap.parse_args(argv)
    from aiorouter import default_models
    from server.ray_serve import require_ray
    models = {name: spec.path for name, spec in default_models().items()}  # run_process passes paths to the CLI
    ray, serve = require_ray(loopback=True)
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    configs = args.configs.split(",")
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    try:
        for rep in range(args.repeats):
            for name in configs if rep % 2 == 0 else configs[::-1]:  # interleaved: drift hits all alike
                if name == "process":
                    r = run_process(models, args)
                else:
                    # uncapped: what every replica ran before it capped threads to its CPUs (the
                    # Router's plan for this machine: the large model gets every core)
                    whole = dict(zip(models, plan_threads([0, 1]))) if name.endswith("-uncapped") else None
                    r = run_ray(serve, f"http://127.0.0.1:{port}", models, int(name.split("-")[1]), args, whole)
                runs[name].append(r)
                print(f"{name} repeat {rep}: {r['tok_s']:.1f} tok/s, outside load {r['outside_load_cores']:.2f} "
                      f"cores, requests per replica {r['requests_per_replica']}", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    med = {k: statistics.median(x["tok_s"] for x in v) for k, v in runs.items()}
    path = write_json("ray_replicas", {"router": ROUTER, "models": "default SmolLM2 pair (small: 10 layers)",
                                       "concurrency": args.concurrency, "requests": args.requests,
                                       "tokens": args.tokens, "median_tok_s": med, "runs": runs})
    print(f"median tok/s: {med}; 2/1 replicas {med['ray-2'] / med['ray-1']:.2f}x; "
          f"1 replica / process {med['ray-1'] / med['process']:.2f}x; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
