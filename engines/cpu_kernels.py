"""The C++ CPU kernels (engines/csrc): paged attention and RMSNorm, built as one extension.

`load()` builds them on first use with the machine's C++ compiler (ninja is a dependency) and
caches the build per source and CPU (it is compiled for the host's instruction set) under
torch's extension directory: ~15 s once per machine. If they cannot be built, it warns once and
returns None; callers then use torch ops (TorchBackend, `F.rms_norm`).
"""
from __future__ import annotations

import functools
import hashlib
import platform
import warnings
from pathlib import Path

import torch

_SOURCES = [Path(__file__).parent / "csrc" / f for f in ("paged_attention_cpu.cpp", "rms_norm_cpu.cpp")]


def _cpu_tag() -> str:
    """Hash of the CPU's feature flags: a build made with -march=native is only valid there."""
    try:
        flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


@functools.cache
def load():
    """-> `torch.ops.aiorouter_cpu` (paged_attention, rms_norm, add_rms_norm), or None."""
    try:
        from torch.utils import cpp_extension
        from tqdm import tqdm
        # one build per CPU and per checkout: ninja's build file names the sources by path, so two
        # checkouts sharing one name rebuilt each other's build on every load (75 s per process start
        # on the shared 2-core machine, where several worktrees serve at once)
        checkout = hashlib.sha1(str(_SOURCES[0].parent.resolve()).encode()).hexdigest()[:6]
        name = f"aiorouter_cpu_kernels_{_cpu_tag()}_{checkout}"
        with tqdm(total=1, desc="building the CPU kernels (once per machine)", leave=False, disable=None) as bar:
            cpp_extension.load(name=name, sources=[str(s) for s in _SOURCES], is_python_module=False,
                               extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing"],
                               extra_ldflags=["-fopenmp"], verbose=False)
            bar.update()
        return torch.ops.aiorouter_cpu
    except Exception as e:  # noqa: BLE001 - any build failure means "use the torch fallback"
        first = str(e).splitlines()[0] if str(e) else ""
        warnings.warn(f"CPU kernels unavailable ({type(e).__name__}: {first}); attention falls back to gather + "
                      "SDPA (~2x slower for decodes) and RMSNorm to torch ops. They need a C++ compiler (g++) "
                      "and ninja.", RuntimeWarning, stacklevel=2)
        return None
