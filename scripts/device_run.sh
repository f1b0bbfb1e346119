#!/usr/bin/env bash
# One call on the GPU machine: set up once, then run a plan's steps in lanes, one lane per GPU,
# every step under its own timeout, every log kept; a table of steps prints last.
#
#   PYNANOQWEN_COMMIT=$(git rev-parse --short HEAD) bash scripts/device_run.sh scripts/plans/NAME.plan
#   (from the repo root, with .whl carried; the commit goes into bench results, since the copy of the
#   tree on the GPU machine carries no trustworthy .git: it reported a stale HEAD in session 2)
#
# A plan line is `lane | timeout seconds | step name | shell command`; '#' starts a comment. Lane
# N runs on GPU N (CUDA_VISIBLE_DEVICES=N), its steps one after another; lanes run side by side.
# A step may wait for another lane's step with `wait_for NAME` (it waits for $LOGS/NAME.done).
# Every step sees $LOGS (its folder for extra files), $MODEL_7B (a random 7B-shaped .nanoqwen,
# written by the `build_7b` step of whichever lane runs it) and PYTHONPATH set to the repo.
# The device tool brings back at most 8 files, so each step's log goes to $LOGS/<step>.log and
# everything in $LOGS is packed into $OUT/logs.tgz at the end, with steps.tsv beside it.
set -uo pipefail
plan=${1:?usage: device_run.sh PLAN}
OUT=${OUT:-out}; mkdir -p "$OUT"
export LOGS=/tmp/device-run-logs; rm -rf "$LOGS"; mkdir -p "$LOGS"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MODEL_7B=/tmp/pynanoqwen-7b.nanoqwen
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$LOGS/gpu.txt"
python3 -c "import numba, numba_cuda, numpy; print('numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'numpy', numpy.__version__)"
printf 'lane\tstep\trc\tseconds\n' > "$LOGS/steps.tsv"

# Pack the logs however the run ends (a `timeout` around this script sends TERM).
pack() { rm -f "$LOGS"/*.done; tar -czf "$OUT/logs.tgz" -C "$LOGS" .; cp "$LOGS/steps.tsv" "$OUT/"; }
trap pack EXIT
trap 'exit 143' TERM

wait_for() { while [ ! -e "$LOGS/$1.done" ]; do sleep 2; done; }
export -f wait_for

run_lane() {
  local lane=$1
  grep -v '^\s*#' "$plan" | grep -v '^\s*$' | while IFS='|' read -r l limit name command; do
    l=$(echo $l); limit=$(echo $limit); name=$(echo $name)
    [ "$l" = "$lane" ] || continue
    local start=$SECONDS
    echo "[lane $lane] $name: $command"
    CUDA_VISIBLE_DEVICES=$lane timeout "$limit" bash -c "$command" > "$LOGS/$name.log" 2>&1
    local rc=$?
    touch "$LOGS/$name.done"
    printf '%s\t%s\t%s\t%s\n' "$lane" "$name" "$rc" "$((SECONDS - start))" >> "$LOGS/steps.tsv"
    echo "[lane $lane] $name: rc=$rc in $((SECONDS - start)) s"
  done
}

lanes=$(grep -v '^\s*#' "$plan" | grep -v '^\s*$' | cut -d'|' -f1 | tr -d ' ' | sort -u)
for lane in $lanes; do run_lane "$lane" & done
wait
echo; tr '\t' ' ' < "$LOGS/steps.tsv"
