"""The GPU check's write-up: machine facts (taken without touching CUDA) and gpu_check.md."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _cmd(*args: str) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=20, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def facts() -> dict:
    from importlib import metadata
    versions = {}
    for dist in ("torch", "triton", "transformers", "flashinfer-python", "cuda-bindings", "numpy", "scipy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return {"python": platform.python_version(), "executable": sys.executable, "cores": os.cpu_count(),
            "load_avg": os.getloadavg(), "commit": _cmd("git", "rev-parse", "--short", "HEAD"),
            "gpu": _cmd("nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm",
                        "--format=csv,noheader"), "versions": versions}


def _f(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.4g}"
    return "-" if v is None else str(v)


def _table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + \
        ["| " + " | ".join(_f(v) for v in r) + " |" for r in rows] + [""]


def write_report(res: dict, path: Path) -> None:
    f = res["facts"]
    lines = [f"# GPU check: {'DRY RUN on CPU, tiny models (no GPU figure here)' if res['dry_run'] else f.get('gpu')}", "",
             f"`bench/gpu/check.py` at {res['started']}, commit {f['commit']}: python {f['python']}, "
             + ", ".join(f"{k} {v}" for k, v in f["versions"].items() if v) + f"; {res.get('wall_s', 0):.0f} s of a "
             f"{res['budget_s']:.0f} s budget. Raw: gpu_check.json; every section's output: gpu_check.log.", ""]
    if res["simulated_triton_failure"]:
        lines += [f"**Simulated Triton failure ({res['simulated_triton_failure']})**: a test of the fallback.", ""]
    lines += [f"**Fallback: {res['fallback']}**: later sections ran the torch backend with CUDA graphs off."
              if res["fallback"] else "No fallback: Triton and CUDA graphs ran wherever asked.", ""]
    for name, body in res["sections"].items():
        lines += [f"## {name}: {body.get('status')} ({body.get('section_s', '-')} s of {body.get('box_s', '-')} s; "
                  f"attention {body.get('attention', '-')}, graphs {body.get('graphs', '-')})", ""]
        if "triton_attempt" in body:
            lines += [f"First attempt with Triton: {body['triton_attempt'].get('status')}: "
                      f"`{body['triton_attempt'].get('error', '')[:300]}`", ""]
        if body.get("status") != "ok":
            lines += ["```", str(body.get("error") or body.get("reason") or ""),
                      str(body.get("traceback") or body.get("output_tail") or "")[-1500:], "```", ""]
        lines += SECTION_WRITERS.get(name, lambda b: [])(body)
    path.write_text("\n".join(lines))


def _triton(b: dict) -> list[str]:
    out = []
    if "cases" in b:
        out += ["Triton against the torch backend on fp32 copies of the inputs (relative error of the output):", ""]
        out += _table(["case", "rel err", "torch backend, same dtype", "K/V stored", "ok"],
                      [[k, v["rel_err"], v["torch_same_dtype_rel_err"], v["kv_stored"], v["ok"]] for k, v in b["cases"].items()])
    if "graph_replay" in b:
        out += [f"CUDA-graph replay of a Triton launch on new inputs: {b['graph_replay']}", ""]
    if "facts" in b:
        out += [f"Device: {b['facts']}", ""]
    return out


def _parity(b: dict) -> list[str]:
    if "candidates" not in b:
        return []
    out = [f"Model {b.get('model')}. Reference: torch backend, fp32. Teacher-forced on its tokens, then free-running greedy; "
           f"bf16 noise yardstick (torch bf16, max abs logit error): {_f(b.get('bf16_noise_abs'))}.", ""]
    rows = [[k, v["first_step_rel_err"], v["decode_rel_err_max"], v["sampled_is_argmax"],
             f"{v['argmax_equals_reference']}/{v['positions']}",
             f"{v['greedy']['sequences_equal']}/{v['greedy']['sequences']}", v["greedy"]["unexplained"],
             v["engine"]["graph_replays"], v["ok"]] for k, v in b["candidates"].items()]
    return out + _table(["candidate", "first-step rel err", "decode rel err max", "sampled = argmax",
                         "argmax = reference", "greedy sequences equal", "unexplained divergences", "graph replays", "ok"], rows)


def _overlap(b: dict) -> list[str]:
    s = b.get("steps")
    if not s:
        return []
    out = [f"{s['k']} decode steps at batch {s['batch']}: alone {_f(s['alone_s'][0])} s and {_f(s['alone_s'][1])} s "
           f"(serial {_f(s['serial_s'])} s), together {_f(s['together_wall_s'])} s: overlap {_f(s['overlap'])} "
           "(1: the shorter hides entirely, 0: serialised).", ""]
    if "timeline" in b:
        out += [f"Profiler timeline: {b['timeline']}", ""]
    return out


def _modes(b: dict) -> list[str]:
    from bench.gpu.modes import PAPER
    rungs = b.get("rungs", {})
    if not rungs:
        return []
    ns = sorted({k for r in rungs.values() for k in r if k.startswith("N=")}, key=lambda k: int(k[2:]))
    base = b.get("ratios_at_main_n", {})
    out = [f"Pair {b['pair']['small']['name']} + {b['pair']['large']['name']}, {b.get('workload')}.", ""]
    out += _table(["rung", "mode", "graphs"] + [f"{n} tok/s" for n in ns] + ["ratio to base", "paper tok/s (N=8)", "paper ratio"],
                  [[k, r.get("mode"), r.get("graphs")] + [r.get(n, {}).get("tok_s") for n in ns] +
                   [base.get(k), PAPER.get(k), PAPER.get(k, 0) / PAPER["base"]] for k, r in rungs.items()])
    return out


def _decode(b: dict) -> list[str]:
    out = []
    for name, m in b.get("models", {}).items():
        out += [f"{name} ({m['model']['params_b']} B parameters; floor {_f(m['floor_ms'])} ms per step: the weights "
                "read once at 4.3 TB/s):", ""]
        rows = []
        for g, r in m.items():
            if g.startswith("graphs="):
                for bsz, v in r.get("results", {}).items():
                    rows.append([g, bsz, v["tok_s"], v["step_ms"]])
                if "skipped" in r:
                    rows.append([g, r["skipped"], None, None])
        out += _table(["graphs", "batch", "tok/s", "step ms"], rows)
    return out


def _host(b: dict) -> list[str]:
    out = []
    if "engine_alone" in b:
        out += _table(["engine alone", "step ms", "ms per token"],
                      [[k, v["step_ms"], v["ms_per_token"]] for k, v in b["engine_alone"].items()])
    if "router_eager" in b:
        out += _table(["router (eager, random p=0.35)", "ms per committed token", "tok/s", "steps (small, large)",
                       "their time alone, per token", "runtime overhead per token"],
                      [[k, v.get("ms_per_token"), v.get("tok_s"), v.get("steps"), v.get("engine_ms_per_token"),
                        v.get("overhead_ms_per_token")] for k, v in b["router_eager"].items() if k.startswith("N=")])
    if "ceiling" in b:  # bench.host_cost on this host: zero-latency sims, eager
        parts = list(next(iter(b["ceiling"].values()))["parts_us_per_token"])
        out += _table(["ceiling (zero-latency sims)", "us per token", "tok/s"] + parts,
                      [[k, v["us_per_token"], v["tok_s"]] + [v["parts_us_per_token"][p] for p in parts]
                       for k, v in b["ceiling"].items()])
    return out


SECTION_WRITERS = {"triton": _triton, "parity": _parity, "overlap": _overlap, "modes": _modes, "decode": _decode,
                   "host": _host}
