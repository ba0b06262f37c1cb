"""One section of the GPU check, in its own process (bench/gpu/check.py starts it): what the
section may use (`Section`: device, backend, graphs, time left, the stream factory) and the
results it writes, to a JSON file that is rewritten on every `put` so a kill keeps what was done."""
from __future__ import annotations

import json
import shutil
import tempfile
import time
import traceback
from pathlib import Path


class SimulatedTritonFailure(RuntimeError):
    """--simulate-triton-failure SECTION: raised where that section would first use Triton."""


class Section:
    def __init__(self, args):
        import torch

        from engines.streams import StreamFactory
        self.name, self.dry = args.section, args.dry_run
        if self.dry:  # the dry run's models are tiny: one thread, no OpenMP team to wait for on a busy machine
            torch.set_num_threads(1)
        self.device = torch.device("cpu" if self.dry else "cuda:0")
        self.dtype = torch.float32 if self.dry else torch.bfloat16
        self.attention = None if args.attention == "default" else "torch"  # None: the device's default (Triton)
        self.graphs = args.graphs == "on"
        self.block_n = 48 if args.simulate_triton_failure == "probe" else 64  # 48: not a power of two
        self.fail_here = args.simulate_triton_failure == self.name
        self.deadline = time.monotonic() + args.deadline_s
        self.streams = StreamFactory()
        self.root = Path(tempfile.mkdtemp(prefix="gpu_check-models-"))
        self.path = Path(args.section_out)
        self.body: dict = {"attention": args.attention, "graphs": self.graphs}

    def left(self) -> float:
        """Seconds until this section's soft deadline (its box minus a margin for writing up)."""
        return self.deadline - time.monotonic()

    def put(self, key: str, value) -> None:
        self.body[key] = value
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.body, indent=1, default=str))
        tmp.replace(self.path)

    def triton_used(self) -> None:
        """The injected failure hook: called where a section first uses Triton."""
        if self.fail_here:
            raise SimulatedTritonFailure(f"simulated Triton failure in section {self.name}")


def run_section(args) -> int:
    from bench.gpu import modes as gpu_modes, parity as gpu_parity, speed as gpu_speed
    funcs = {"triton": gpu_parity.probe, "parity": gpu_parity.parity, "overlap": gpu_speed.overlap,
             "modes": gpu_modes.modes, "decode": gpu_speed.decode, "host": gpu_speed.host}
    sec = Section(args)
    t0 = time.perf_counter()
    try:
        if args.section != "parity" and args.section != "triton" and (sec.attention is None or sec.graphs):
            sec.triton_used()  # parity calls it itself (its torch-backend references come first)
        funcs[args.section](sec)
        sec.body["status"] = "ok"
    except BaseException as e:  # noqa: BLE001 (recorded; the parent decides on a fallback)
        sec.body.update(status="error", error=repr(e), traceback=traceback.format_exc()[-4000:])
    finally:
        sec.body["streams"] = [r._asdict() for r in sec.streams.records()]
        sec.body["run_s"] = round(time.perf_counter() - t0, 1)
        sec.flush()
        shutil.rmtree(sec.root, ignore_errors=True)
    return 0
