#!/usr/bin/env bash
# The one device call of issue 20 (bench/gpu/README.md gives the exact `run` call): installs what
# the device machine lacks from the carried wheel folder .whl/ (bench/gpu/wheels.sh builds it; only
# distributions it does not have, into /tmp/site: its torch and triton stay untouched), runs the GPU
# check, then the gpu-marked tests with the time that is left. Everything within 8 minutes
# (GPU_RUN_BUDGET_S, default 470 s); everything it writes lands in $OUT (else bench/results/gpu_check):
#   gpu_run.log      this script's output          gpu_check.json  every figure, rewritten per section
#   gpu_check.md     the figures as tables          gpu_check.log   each section's own output
#   pytest-gpu.log   the gpu-marked tests
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
BUDGET=${GPU_RUN_BUDGET_S:-470}
TESTS_S=75  # kept for the gpu-marked tests (Triton compiles for ~20 kernel variants there)
export OUT=${OUT:-bench/results/gpu_check} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
left() { echo $((BUDGET - (SECONDS - T0))); }

main() {
echo "== machine"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,temperature.gpu,clocks.sm,clocks.max.sm \
  --format=csv || echo "nvidia-smi failed"
python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.is_available())"

echo "== wheels"
site=/tmp/site
missing=()
for w in .whl/*.whl; do
  [ -e "$w" ] || { echo "no .whl folder: nothing installed (run bench/gpu/wheels.sh, carry .whl)"; break; }
  dist=$(basename "$w" | cut -d- -f1)
  if python3 -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$dist" 2>/dev/null; then
    echo "present: $dist"
  else
    missing+=("$w")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${missing[@]}" \
    && echo "installed into $site: ${missing[*]}" || echo "wheel install failed (the check needs none of them)"
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"

echo "== check ($(left) s left)"
check_s=$(( $(left) - TESTS_S ))
# the check keeps its own budget; the timeout only guards against a hang outside its sections
timeout -s INT -k 10 $((check_s + 20)) python3 -m bench.gpu.check --out "$OUT" --budget-s "$check_s"
echo "check exit $?"

echo "== gpu-marked tests ($(left) s left)"
if [ "$(left)" -gt 40 ]; then
  timeout -s INT -k 10 $(( $(left) - 5 )) python3 -m pytest -m gpu -q -rA -p no:cacheprovider \
    tests/test_triton_kernels.py tests/test_gpu_graphs.py tests/test_gpu_sampling.py tests/test_streams.py \
    tests/test_gpu_networks.py > "$OUT/pytest-gpu.log" 2>&1
  echo "pytest exit $?"
  tail -n 25 "$OUT/pytest-gpu.log"
else
  echo "skipped: too little time left"
fi

echo "== summary ($((SECONDS - T0)) s)"
python3 - "$OUT/gpu_check.json" <<'EOF'
import json, sys
try:
    res = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no results: {e!r}")
print("fallback:", res.get("fallback"))
for name, s in res["sections"].items():
    print(f"{name:8s} {s.get('status'):10s} {s.get('section_s', '-')} s  ok={s.get('ok', '-')}  {str(s.get('error', ''))[:160]}")
for rung, r in res["sections"].get("modes", {}).get("rungs", {}).items():
    print(f"  {rung:9s}", {k: round(v["tok_s"], 1) for k, v in r.items() if k.startswith("N=") and "tok_s" in v})
EOF
ls -l "$OUT"
}

# a pipeline, not `exec > >(tee ...)`: the script then ends only after tee has written the log
main 2>&1 | tee "$OUT/gpu_run.log"
