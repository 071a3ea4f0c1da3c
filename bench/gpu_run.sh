#!/usr/bin/env bash
# One GPU session for the kernel work: install the carried wheels and the project, run the GPU
# tests and the kernel benchmark, and leave every log under $OUT (the device tool fetches it).
#   bench/gpu_run.sh [tests|bench|variants|record|next|all|none]  extra bench args in $BENCH_ARGS
# next: the every-variant correctness tests (old launch shapes and the unmeasured weights-staged
#       q6k_mma_ws ones, SoA/AoS bit-identity), then old vs new variants timed on the three
#       ANCHORS shapes, ending with a one-line-per-(shape, N) summary table (docs/KERNELS.md).
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
MODE=${1:-all}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
  --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
git log -1 --format='commit %H %s' 2>/dev/null | tee "$OUT/commit.txt"
rc=0
if [[ $MODE == tests || $MODE == all ]]; then
  timeout "${TEST_TIMEOUT:-360}" python3 -m pytest -m gpu -q -rfE --maxfail=20 -p no:cacheprovider \
    tests/kernels/test_cuda_backend.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
  rc=${PIPESTATUS[0]}
fi
if [[ $MODE == bench || $MODE == all ]]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-300}" python3 bench/kernels.py ${BENCH_ARGS:-} --json "$OUT/bench.json" \
    2>&1 | tee "$OUT/bench.log" | grep -v "^$" | tail -120
fi
if [[ $MODE == record ]]; then  # every path, every launch variant, torch, in one run
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-300}" python3 bench/kernels.py --variants ${BENCH_ARGS:-} \
    --json "$OUT/record.json" 2>&1 | tee "$OUT/record.log" | grep -v "^$" | tail -200
fi
if [[ $MODE == variants ]]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-300}" python3 bench/kernels.py --variants --no-torch \
    --paths auto,exact,mmq_q8_1 ${BENCH_ARGS:-} --json "$OUT/variants.json" 2>&1 \
    | tee "$OUT/variants.log" | grep -v "^$" | tail -150
fi
if [[ $MODE == next ]]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -m gpu -q -rfE --maxfail=20 -p no:cacheprovider \
    tests/kernels/test_cuda_backend.py \
    -k "every_launch_variant or ws_ or bit_identical or shape_aware or plan_names or without_a" \
    2>&1 \
    | tee "$OUT/pytest_next.log" | tail -25
  rc=${PIPESTATUS[0]}
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-300}" python3 bench/kernels.py --variants --ws --summary --no-torch \
    --paths auto --shapes 4096x14336,3584x18944,152064x3584 ${BENCH_ARGS:-} \
    --json "$OUT/next.json" >"$OUT/next.log" 2>&1
  brc=$?
  grep -E "FAILED|Error" "$OUT/next.log" | head -20
  echo "# pytest (new variants + every-variant): rc=$rc; bench rc=$brc (124 = timed out)"
  sed -n '/^# summary/,$p' "$OUT/next.log"
fi
exit "$rc"
