#!/usr/bin/env bash
# One call on the GPU machine: set up, run the gpu-marked tests and the GPU check, keep every log.
# Usage there (from the repo root, with .whl carried):  bash scripts/device_run.sh [pytest selection...]
# Logs go to $OUT (the device tool's output folder; ./out elsewhere); a short table prints last.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import numba, numba_cuda, numpy; print('numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'numpy', numpy.__version__)"
sel=("$@"); [ ${#sel[@]} -gt 0 ] || sel=(tests)
timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -s -rfE -p no:cacheprovider "${sel[@]}" 2>&1 | tee "$OUT/pytest_gpu.log"
echo "pytest rc=${PIPESTATUS[0]}"
if [ -n "${GPU_CHECK:-}" ]; then
  timeout "${GPU_CHECK_TIMEOUT:-240}" python3 scripts/gpu_check.py $GPU_CHECK 2>&1 | tee "$OUT/gpu_check.log"
  echo "gpu_check rc=${PIPESTATUS[0]}"
fi
grep -E "passed|failed|error" "$OUT/pytest_gpu.log" | tail -3
