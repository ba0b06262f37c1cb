"""The GPU check of issue 8, one script, one call, under 8 minutes on one GPU:

1. greedy parity of each attention backend (triton, torch, flashinfer if installed) against the
   torch backend on a tiny random Qwen3 in bf16 (and triton in fp32, where it must be exact);
2. CUDA-graph parity: graphs on vs off, same tokens;
3. decode tokens/s of the large model alone at batch 1, 8, 64 (graphs on and off);
4. the cpu-tiny-shaped mode benchmark (bench/modes.py: random routing p=0.35) scaled to GPU sizes
   (small: hidden 1024 / 8 layers, large: hidden 4096 / 32 layers, random weights) for sync,
   eager, delayed at N = 1, 4, 16.

Writes bench/results/gpu_check.json and bench/RESULTS-gpu.md (with the device name).
Models are built in memory with random weights (no checkpoint on disk, no network).

    python bench/gpu_check.py            # on a CUDA machine
    python bench/gpu_check.py --dry-run  # on CPU: tiny sizes, torch backend (triton under its
                                         # interpreter when installed): proves the script runs
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

if not torch.cuda.is_available():  # CPU dry run: Triton kernels only under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engines import Engine, EngineConfig, ModelConfig, SamplingParams  # noqa: E402
from engines.attention import has_module  # noqa: E402
from engines.cuda_graph import StepGraphs  # noqa: E402
from engines.model import CausalLM  # noqa: E402

SHAPES = {  # (hidden, layers, heads, kv heads, head dim, vocab)
    "full": {"parity": (256, 4, 4, 2, 64, 4096), "small": (1024, 8, 16, 4, 64, 4096),
             "large": (4096, 32, 32, 8, 128, 4096)},
    "dry": {"parity": (64, 2, 4, 2, 16, 512), "small": (64, 2, 4, 2, 16, 512), "large": (128, 3, 4, 2, 32, 512)},
}


def model_config(shape: tuple) -> ModelConfig:
    h, layers, heads, kv, d, vocab = shape
    return ModelConfig(model_type="qwen3", vocab_size=vocab, hidden_size=h, intermediate_size=3 * h,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=d,
                       rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=False,
                       attention_bias=False, mlp_bias=False, qk_norm=True, eos_token_ids=(1,), bos_token_id=0)


@torch.no_grad()
def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """Random weights made on the device (seconds for 6B parameters, where an HF init takes minutes)."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    g = torch.Generator(device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, device=device))
        else:
            p.copy_(torch.randn(p.shape, generator=g, device=device) * 0.02)
    return model.eval()


def make_engine(model: CausalLM, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, backend: str | None,
                graphs: bool, ecfg: EngineConfig) -> Engine:
    """An Engine around an in-memory model (several engines may share one model: weights are read-only)."""
    return Engine.from_model(model, cfg, device, dtype, ecfg, attention_backend=backend, cuda_graphs=graphs)


def greedy(eng: Engine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], torch.Tensor]:
    """-> (generated tokens per prompt, logits of the first generated position [B, V])."""
    seqs = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for p in prompts]
    first = {}
    while any(not s.is_finished for s in seqs):
        out = eng.forward()
        for s, t, lg in zip(out.seqs, out.next_tokens, out.logits):
            first.setdefault(s.seq_id, lg)
            eng.append_token(s, t)
    return [s.output_ids for s in seqs], torch.stack([first[s.seq_id] for s in seqs])


def compare(ref: tuple, got: tuple) -> dict:
    (rt, rl), (gt, gl) = ref, got
    same = sum(a == b for a, b in zip(rt, gt))
    agree = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(rt, gt)]
    rel = ((gl - rl).norm(dim=-1) / rl.norm(dim=-1)).max().item()
    return {"sequences_equal": f"{same}/{len(rt)}", "all_equal": same == len(rt),
            "min_tokens_agreeing": min(agree), "first_logits_max_rel_err": rel}


def _error(e: BaseException) -> dict:
    return {"error": repr(e), "traceback": traceback.format_exc()[-2000:]}


def _guarded(fn) -> dict:
    """One backend's failure is a result, not the end of the section."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return _error(e)


def check_parity(dev: torch.device, shapes: dict, backends: list[str], tokens: int) -> dict:
    cfg = model_config(shapes["parity"])
    rng = random.Random(0)
    prompts = [[rng.randrange(2, cfg.vocab_size) for _ in range(n)] for n in (5, 37, 120, 2, 64, 9)]
    ecfg = EngineConfig(num_kv_tokens=4096, max_num_batched_tokens=48)  # chunked prefill: mixed steps too
    out: dict = {"backends": {}, "graphs": {}}

    def graphed(model, dtype, be, eager):
        if dev.type == "cuda":
            t0 = time.perf_counter()
            eng = make_engine(model, cfg, dev, dtype, be, True, ecfg)
            capture_s, name = time.perf_counter() - t0, None
        else:  # dry run: StepGraphs' CPU stand-in for a capture (nothing captured)
            eng = make_engine(model, cfg, dev, dtype, be, False, ecfg)
            r = eng.runner
            r.graphs = StepGraphs(r._forward_one, r.backend, r.page_size, -(-r.max_model_len // r.page_size), dev)
            r.graphs.capture()
            capture_s, name = 0.0, "TritonBackend (CPU stand-in, nothing captured)"
        res = compare(eager, greedy(eng, prompts, tokens))
        g = eng.runner.graphs
        res.update(graphs=len(g.graphs) if g else 0, replays=g.num_replays if g else 0, capture_s=capture_s,
                   graph_backend=name or (type(g.backend).__name__ if g else None))  # flashinfer/torch: Triton's
        return res

    for dtype in (torch.bfloat16, torch.float32):
        dname = str(dtype).removeprefix("torch.")
        model = random_model(cfg, dev, dtype)
        ref = greedy(make_engine(model, cfg, dev, dtype, "torch", False, ecfg), prompts, tokens)
        for be in backends:
            eager = ref
            if be != "torch":
                try:
                    eager = greedy(make_engine(model, cfg, dev, dtype, be, False, ecfg), prompts, tokens)
                    out["backends"][f"{be}/{dname}"] = compare(ref, eager)
                except Exception as e:  # noqa: BLE001
                    out["backends"][f"{be}/{dname}"] = _error(e)
                    continue
            if dev.type == "cuda" or be == "triton":  # graphs on vs off: same tokens as the same backend eager
                out["graphs"][f"{be}/{dname}"] = _guarded(lambda: graphed(model, dtype, be, eager))
    return out


def decode_tok_s(dev: torch.device, shapes: dict, batches: list[int], steps: int, backend: str | None) -> dict:
    cfg = model_config(shapes["large"])
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = random_model(cfg, dev, dtype)
    rng = random.Random(1)
    out = {}
    for graphs in ([True, False] if dev.type == "cuda" else [False]):
        ecfg = EngineConfig(num_kv_tokens=max(batches) * (128 + steps + 8) + 256, max_num_seqs=max(batches),
                            max_num_batched_tokens=8192, enable_prefix_caching=False)
        eng = make_engine(model, cfg, dev, dtype, backend, graphs, ecfg)
        for b in batches:
            seqs = [eng.add_request([rng.randrange(2, cfg.vocab_size) for _ in range(128)],
                                    SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True))
                    for _ in range(b)]
            for _ in range(2):  # prefill + a warm-up decode
                eng.step()
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            dt = time.perf_counter() - t0
            while eng.has_unfinished():
                eng.step()
            out[f"graphs={graphs}/batch={b}"] = {"tok_s": b * steps / dt, "step_ms": 1000 * dt / steps}
            assert all(s.is_finished for s in seqs)
        del eng
    return {"model": dict(zip(("hidden", "layers", "heads", "kv_heads", "head_dim", "vocab"), shapes["large"])),
            "dtype": str(dtype), "backend": backend or "default", "results": out}


def router_modes(dev: torch.device, shapes: dict, ns: list[int], tokens: int, per_client: int,
                 backend: str | None) -> dict:
    """bench/modes.py on the scaled pair: the Router builds no engines here, it is handed these."""
    from aiorouter import Router
    from bench.common import closed_loop
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    engines = {}
    for name in ("small", "large"):
        cfg = model_config(shapes[name])
        ecfg = EngineConfig(num_kv_tokens=16 * 400 + 512, max_num_seqs=64, enable_prefix_caching=False)
        engines[name] = make_engine(random_model(cfg, dev, dtype, seed=3), cfg, dev, dtype, backend, True, ecfg)
    vocab = model_config(shapes["small"]).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(80, 120))] for _ in range(64)]

    async def run(mode: str, n: int) -> dict:
        r = Router(engines, policy="random", policy_args={"p": 0.35, "seed": 7},  # in-memory engines, reused
                   entry="small", mode=mode, device=str(dev), max_concurrency=max(16, n))
        async with r:
            async def send(p):
                async for ev in r.stream(p, max_tokens=tokens, temperature=0.0, ignore_eos=True):
                    yield ev.model
            await closed_loop(send, 1, prompts, 1)  # warm-up
            await r.wait_tuned()
            res = (await closed_loop(send, n, prompts, n * per_client)).summary()
            res["thresholds"] = r.thresholds(n)
            res["mean_batch"] = {k: m.mean_batch_size for k, m in r.metrics.models.items()}
            return res

    rows = {}
    for n in ns:
        for mode in ("sync", "eager", "delayed"):
            rows[f"{mode}@{n}"] = asyncio.run(run(mode, n))
    return {"backend": backend, "pair": {k: dict(zip(("hidden", "layers", "heads", "kv_heads", "head_dim", "vocab"), shapes[k]))
                     for k in ("small", "large")}, "tokens": tokens, "policy": "random p=0.35", "results": rows}


def device_facts(dev: torch.device) -> dict:
    facts = {"device": dev.type, "torch": torch.__version__, "triton": None, "flashinfer": None}
    if dev.type == "cuda":
        facts.update(device=torch.cuda.get_device_name(dev), cuda=torch.version.cuda,
                     memory_gib=round(torch.cuda.get_device_properties(dev).total_memory / 2**30, 1))
    for mod in ("triton", "flashinfer"):
        if has_module(mod):
            try:
                facts[mod] = __import__(mod).__version__
            except Exception as e:  # noqa: BLE001 (recorded, not fatal)
                facts[mod] = f"import failed: {e!r}"
    return facts


def _table(head: list[str], rows: list[list]) -> list[str]:
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(map(fmt, r)) + " |" for r in rows]


def write_report(res: dict, path: Path) -> None:
    f, sec = res["facts"], res["sections"]
    lines = [f"# GPU check ({'DRY RUN on CPU: no GPU numbers' if res['dry_run'] else f['device']})", "",
             "Written by `bench/gpu_check.py`" + (" --dry-run" if res["dry_run"] else "") + f" at {res['time']}: "
             f"torch {f['torch']}, CUDA {f.get('cuda')}, triton {f['triton']}, flashinfer {f['flashinfer']}; "
             f"{res.get('wall_s', 0):.0f} s in all. Raw numbers: bench/results/gpu_check.json.", ""]
    if res["dry_run"]:
        lines += ["A dry run shows that the script runs end to end on CPU with tiny models (torch backend;",
                  "Triton under its interpreter; graphs as StepGraphs' CPU stand-in, which re-runs the padded",
                  "static buffers instead of capturing). Nothing below measures or verifies a GPU: no CUDA",
                  "stream, graph capture, compiled Triton kernel, flashinfer call or GPU sampler has run yet.", ""]
    for name, body in sec.items():
        lines += [f"## {name} ({body.get('section_s', '-')} s)", ""]
        if "error" in body or "skipped" in body:
            lines += ["```", body.get("error") or body["skipped"], body.get("traceback", ""), "```", ""]
            continue
        if name == "parity":
            head = ["backend/dtype", "sequences equal", "min tokens agreeing", "first logits max rel err"]
            lines += ["Greedy tokens against the torch backend, graphs off:", ""]
            lines += _table(head, [[k, v["sequences_equal"], v["min_tokens_agreeing"], v["first_logits_max_rel_err"]]
                                   for k, v in body["backends"].items()]) + [""]
            if body["graphs"]:
                lines += ["CUDA graphs on against off (same backend; small steps replay graphs of graph_backend):", ""]
                lines += _table(head[:3] + ["graphs", "replays", "capture s", "graph_backend"],
                                [[k, v["sequences_equal"], v["min_tokens_agreeing"], v["graphs"], v["replays"],
                                  v["capture_s"], v["graph_backend"]] for k, v in body["graphs"].items()]) + [""]
        elif name == "decode":
            lines += [f"Large model alone ({body['model']}), {body['dtype']}, backend {body['backend']} "
                      "(with graphs, decode steps up to the largest bucket replay Triton-backend graphs):", ""]
            lines += _table(["graphs/batch", "tok/s", "step ms"],
                            [[k, v["tok_s"], v["step_ms"]] for k, v in body["results"].items()]) + [""]
        elif name == "modes":
            lines += [f"Routed pair {body['pair']}, backend {body['backend']}, graphs on, {body['policy']}, "
                      f"{body['tokens']} tokens per request:", ""]
            lines += _table(["mode@N", "tok/s", "ttft p50 s", "mean batch", "thresholds"],
                            [[k, v["tok_s"], v["ttft_p50"], v["mean_batch"], v["thresholds"]]
                             for k, v in body["results"].items()]) + [""]
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (the default without CUDA)")
    ap.add_argument("--budget-s", type=float, default=450, help="skip sections that would start after this")
    ap.add_argument("--sections", default="parity,decode,modes")
    ap.add_argument("--out", type=Path, default=ROOT / "bench", help="writes OUT/RESULTS-gpu.md, OUT/results/gpu_check.json")
    args = ap.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    dev = torch.device("cpu" if dry else "cuda:0")
    shapes = SHAPES["dry" if dry else "full"]
    interp = os.environ.get("TRITON_INTERPRET") == "1"  # on CPU only the interpreter runs Triton kernels
    backends = ["torch"] + [b for b in ("triton", "flashinfer") if has_module(b) and (dev.type == "cuda" or (b == "triton" and interp))]
    t_start = time.perf_counter()
    res = {"dry_run": dry, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "facts": device_facts(dev), "sections": {}}
    def best_backend() -> str | None:
        """The default backend, unless the parity section saw it fail; then the next that worked."""
        if dry:
            return "torch"
        par = res["sections"].get("parity", {})
        failed = {k.split("/")[0] for k, v in {**par.get("backends", {}), **par.get("graphs", {})}.items()
                  if "error" in v and k.endswith("bfloat16")}  # the benchmarks run bf16 (flashinfer may refuse fp32)
        return next((b for b in ("flashinfer", "triton", "torch") if b in backends and b not in failed), "torch")

    plan = {
        "parity": lambda: check_parity(dev, shapes, backends, 8 if dry else 32),
        "decode": lambda: decode_tok_s(dev, shapes, [1, 8] if dry else [1, 8, 64], 4 if dry else 64, best_backend()),
        "modes": lambda: router_modes(dev, shapes, [1, 4] if dry else [1, 4, 16], 8 if dry else 64, 1 if dry else 2,
                                      best_backend()),
    }
    out_json, out_md = args.out / "results" / "gpu_check.json", args.out / "RESULTS-gpu.md"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    ok = True
    for name in args.sections.split(","):
        if time.perf_counter() - t_start > args.budget_s:
            res["sections"][name] = {"skipped": f"time budget ({args.budget_s:.0f} s) spent"}
            continue
        t0 = time.perf_counter()
        try:
            body = plan[name]()
        except Exception as e:  # noqa: BLE001: one failed section must not lose the others' results
            ok = False
            body = _error(e)
        body["section_s"] = round(time.perf_counter() - t0, 1)
        res["sections"][name] = body
        print(f"[gpu_check] {name}: {body['section_s']} s", flush=True)
        res["wall_s"] = time.perf_counter() - t_start
        out_json.write_text(json.dumps(res, indent=2, default=str))  # after every section: a timeout keeps the rest
        write_report(res, out_md)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(f"[gpu_check] wrote {out_json} and {out_md}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
