"""The C++ CPU kernels (engines/csrc): paged attention, RMSNorm and the AMX int4 linear, built as
one extension.

`load()` builds them on first use with the machine's C++ compiler (ninja is a dependency) and
caches the build per source folder and CPU (it is compiled for the host's instruction set) under
torch's extension directory: ~15 s once per machine. If they cannot be built, it warns once and
returns None; callers then use torch ops (TorchBackend, `F.rms_norm`).
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

_SOURCES = [Path(__file__).parent / "csrc" / f for f in ("paged_attention_cpu.cpp", "rms_norm_cpu.cpp",
                                                        "int4_linear_cpu.cpp")]


def _build_tag() -> str:
    """Hash of the CPU's feature flags (a build made with -march=native is only valid there), of
    the sources' folder (torch's build.ninja names the source paths, so two checkouts sharing one
    build folder would rebuild it in turn, ~15 s each, under a lock every other process waits on)
    and of the sources themselves (so an updated checkout builds anew in a folder of its own, and
    says so, instead of torch rebuilding the old one without a word)."""
    try:
        flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    h = hashlib.sha1((flags + str(_SOURCES[0].parent.resolve())).encode())
    for src in _SOURCES:
        h.update(src.read_bytes())
    return h.hexdigest()[:8]


def _build_dir(name: str) -> Path:
    """torch's own choice (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/py311_cpu), made here so
    that whether a build exists can be checked before the build starts."""
    from torch.utils import cpp_extension
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        accel = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
        root = Path(cpp_extension.get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}" \
            f"{getattr(sys, 'abiflags', '')}_{accel}"
    out = Path(root) / name
    out.mkdir(parents=True, exist_ok=True)
    return out


@functools.cache
def load():
    """-> `torch.ops.aiorouter_cpu` (paged_attention, rms_norm, add_rms_norm, int4_linear and
    int4_linear_available), or None."""
    try:
        from torch.utils import cpp_extension
        name = f"aiorouter_cpu_kernels_{_build_tag()}"
        build_dir = _build_dir(name)
        # a first run waits ~15 s here: say so, on stderr (a progress line, whether or not logging is set up)
        fresh = not (build_dir / f"{name}.so").is_file()
        if fresh:
            print(f"aiorouter: compiling the CPU kernels (paged attention, RMSNorm, int4 linear) into {build_dir}, "
                  "once per machine and version (~15-25 s)", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        cpp_extension.load(name=name, sources=[str(s) for s in _SOURCES], is_python_module=False,
                           extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing"],
                           extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
        if fresh:
            print(f"aiorouter: CPU kernels compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        return torch.ops.aiorouter_cpu
    except Exception as e:  # noqa: BLE001 - any build failure means "use the torch fallback"
        first = str(e).splitlines()[0] if str(e) else ""
        warnings.warn(f"CPU kernels unavailable ({type(e).__name__}: {first}); attention falls back to gather + "
                      "SDPA (~2x slower for decodes) and RMSNorm to torch ops. They need a C++ compiler (g++) "
                      "and ninja.", RuntimeWarning, stacklevel=2)
        return None


def int4_amx_available() -> bool:
    """Are the CPU kernels built with the AMX int4 linear, and does this CPU (and OS) run it?"""
    ops = load()
    return ops is not None and bool(ops.int4_linear_available())
