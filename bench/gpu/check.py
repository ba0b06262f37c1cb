#!/usr/bin/env python3
"""The GPU check (issue 20): one prepared run that verifies the GPU path and brings back every
figure, within 8 minutes on one H200 (bench/gpu/run.sh runs it; bench/gpu/README.md has the call).

Sections, most valuable first; each runs in a process of its own under a time box, so a hang, a
crash or a sticky CUDA error (an illegal address poisons the whole context) costs one section:
  triton   Triton kernels against the torch backend at the real head shapes, bf16 and fp32,
           and a Triton launch replayed from a CUDA graph              (bench/gpu/parity.py)
  parity   engine parity: logits error teacher-forced, greedy agreement (bench/gpu/parity.py)
  overlap  two models' streams: step loops alone and together, a profiler timeline
  modes    the paper's ablation (base, +graphs, +async, +delayed) at N = 8, then N = 1, 4, 16
  decode   decode tokens/s of a ~1B and a ~7B Qwen3 at batch 1, 8, 64, 256, graphs on and off
  host     the runtime's host time per committed token                 (bench/gpu/speed.py)
Fallback: when the triton section fails, or a section fails with Triton and passes on a rerun
without it, every later section runs on the torch backend with CUDA graphs off (graphs capture
with Triton) and the results say so ("fallback").

Writes OUT/gpu_check.json (again after every section), OUT/gpu_check.md and OUT/gpu_check.log
(every section's output). OUT: --out, else $OUT (the folder the device machine sends back),
else bench/results/gpu_check/.

    python3 -m bench.gpu.check              # a CUDA machine (bench/gpu/check.py as a file runs too)
    python3 -m bench.gpu.check --dry-run    # CPU: tiny models, the same sections and files
    python3 -m bench.gpu.check --dry-run --simulate-triton-failure parity     # the fallback path
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run as a file, this folder would come first on sys.path and its modules (models, report, ...)
# would shadow any top-level module of those names: the repository root takes its place.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

# name -> (time box in s on the GPU, in a dry run). modes: 4 routers over a 32B + 0.6B pair.
SECTIONS = {"triton": (60, 40), "parity": (50, 60), "overlap": (40, 30), "modes": (150, 90), "decode": (70, 30),
            "host": (30, 40)}
MIN_BOX = 15  # a section given less is skipped: process start, CUDA init and compiles eat that much


def out_dir(arg: str | None) -> Path:
    return Path(arg or os.environ.get("OUT") or ROOT / "bench" / "results" / "gpu_check")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny models on CPU (the default without CUDA)")
    ap.add_argument("--out", help="output folder (default: $OUT, else bench/results/gpu_check)")
    ap.add_argument("--budget-s", type=float, default=400, help="all sections together (run.sh: 400 of its 480 s)")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--simulate-triton-failure", choices=["probe"] + [s for s in SECTIONS if s != "triton"],
                    metavar="probe|SECTION",
                    help="probe: the triton section compiles with a block size Triton refuses (a real Triton "
                         "error); SECTION: that section fails where it would first use Triton (a failure hook)")
    ap.add_argument("--section", help=argparse.SUPPRESS)  # a child: run this one section
    ap.add_argument("--section-out", help=argparse.SUPPRESS)
    ap.add_argument("--attention", default="default", choices=["default", "torch"], help=argparse.SUPPRESS)
    ap.add_argument("--graphs", default="on", choices=["on", "off"], help=argparse.SUPPRESS)
    ap.add_argument("--deadline-s", type=float, default=60, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.section:
        from bench.gpu.section import run_section
        return run_section(args)
    unknown = [s for s in args.sections.split(",") if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    dry = args.dry_run or not _has_cuda()
    return orchestrate(args, dry, out_dir(args.out))


def _has_cuda() -> bool:
    """Without importing torch here (the parent stays light): ask a child."""
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def orchestrate(args, dry: bool, out: Path) -> int:
    from bench.gpu.report import facts, write_report
    out.mkdir(parents=True, exist_ok=True)
    res = {"dry_run": dry, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": args.budget_s,
           "simulated_triton_failure": args.simulate_triton_failure, "facts": facts(), "fallback": None, "sections": {}}
    t0 = time.monotonic()
    log = out / "gpu_check.log"
    log.write_text("")
    for name in args.sections.split(","):
        left = args.budget_s - (time.monotonic() - t0)
        box = min(SECTIONS[name][1 if dry else 0], left)
        if box < MIN_BOX:
            res["sections"][name] = {"status": "skipped", "reason": f"budget spent ({left:.0f} s left)"}
        else:
            plain = res["fallback"] is None
            body = spawn(name, args, dry, plain, box, log)
            if name == "triton" and plain and _triton_failed(body):
                res["fallback"] = f"the triton section failed ({body.get('status')}): {body.get('error', '')[:300]}"
            elif plain and name != "triton" and body.get("status") in ("error", "crashed"):
                left = args.budget_s - (time.monotonic() - t0)
                if left >= MIN_BOX:  # without Triton: if that runs, Triton (or graphs) was the failure
                    first, body = body, spawn(name, args, dry, False, min(SECTIONS[name][1 if dry else 0], left), log)
                    body["triton_attempt"] = first
                    if body.get("status") == "ok":
                        res["fallback"] = f"section {name} failed with Triton and CUDA graphs and ran without them"
            res["sections"][name] = body
        res["wall_s"] = round(time.monotonic() - t0, 1)
        _write_json(out / "gpu_check.json", res)
        write_report(res, out / "gpu_check.md")
        print(f"[gpu_check] {name}: {res['sections'][name].get('status')} "
              f"({res['sections'][name].get('section_s', '-')} s; {res['wall_s']} s in all)", flush=True)
    print(f"[gpu_check] wrote {out}/gpu_check.json, gpu_check.md, gpu_check.log", flush=True)
    return 0


def _triton_failed(body: dict) -> bool:
    """The probe raised or crashed, or its box ran out before one kernel ran (a slow compile alone,
    with kernels that ran, is no reason to give Triton up)."""
    if body.get("status") == "timed out":
        return not any(c.get("ok") for c in body.get("cases", {}).values())
    return body.get("status") != "ok"


def spawn(name: str, args, dry: bool, plain: bool, box: float, log: Path) -> dict:
    """Run one section in a child process under `box` seconds; -> its results (what it wrote
    before dying or being killed counts too)."""
    fd, tmp = tempfile.mkstemp(prefix=f"gpu_check-{name}-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "bench.gpu.check", "--section", name, "--section-out", tmp,
           "--attention", "default" if plain else "torch", "--graphs", "on" if plain else "off",
           "--deadline-s", str(max(5.0, box - 10))]
    if dry:
        cmd.append("--dry-run")
    if args.simulate_triton_failure:
        cmd += ["--simulate-triton-failure", args.simulate_triton_failure]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if dry:  # CPU only, Triton under its interpreter (read when triton is first imported)
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=ROOT)
    try:
        output, timed_out = proc.communicate(timeout=box)[0], False
    except subprocess.TimeoutExpired:
        # SIGINT first: the child unwinds (writes what it has, releases file locks such as torch's
        # extension-build baton, which a killed build leaves behind for every later process)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            output = proc.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and whatever it started (compilers)
            output = proc.communicate()[0]
        timed_out = True
    with log.open("a") as f:
        f.write(f"===== {name} (attention {'default' if plain else 'torch'}, graphs {'on' if plain else 'off'}) =====\n")
        f.write(output or "")
    try:
        body = json.loads(Path(tmp).read_text() or "{}")
    except json.JSONDecodeError:
        body = {}
    finally:
        os.unlink(tmp)
    if timed_out:
        body["status"] = "timed out"
    elif "status" not in body:  # died without a word: a crash (signal, abort) or a CUDA hard fault
        body.update(status="crashed", returncode=proc.returncode)
    if body["status"] != "ok":
        body["output_tail"] = (output or "")[-3000:]
    body["section_s"] = round(time.monotonic() - t0, 1)
    body["box_s"] = round(box)
    return body


def _write_json(path: Path, res: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
