#!/usr/bin/env bash
# Builds .whl/ (git-ignored): the wheels bench/gpu/run.sh installs on the device machine, which has
# no registry. That machine (KINDS.md beside the device README) has Python 3.12 with torch 2.11
# (CUDA 13), triton 3.6, transformers, numpy, scipy, safetensors, aiohttp, uvloop, prometheus-client,
# cuda-bindings and pytest, but not pydantic (server/), gguf (the default model) or pytest-asyncio
# (the test suite's config). Versions are this project's tested ones; their own dependencies are
# either here or already there (gguf: numpy, pyyaml, requests, tqdm). Run from anywhere:
#     bash bench/gpu/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
        gguf==0.19.0 pytest-asyncio==1.5.0)
rm -rf .whl && mkdir .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${WHEELS[@]}"
size=$(du -sk .whl | cut -f1)
ls -1 .whl
echo "$(ls .whl | wc -l) wheels, ${size} KiB (a device call carries 64 MiB in all)"
[ "$size" -lt 20000 ] || { echo "the wheel folder is too large for a device call" >&2; exit 1; }
