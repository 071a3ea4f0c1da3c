#!/usr/bin/env bash
# One GPU session for the service fast path (issue 14), <= ~270 s with the install:
#  1. the kernel alone: bench/kernels.py, ffn_down 3584x18944 N=1, AUTO path (kernels.log);
#  2. one worker for T1 (one caller, N=1, f16, ffn_down, MatmulStream, against a bare gRPC echo
#     of the same sizes), the lm-head target (N=64, 8 callers, top-64) and the 7B decode replay
#     (S = 1, 8, 64, with and without multi-weight calls, f16 y): bench/service.py --target-report
#     --targets T1 --lm-head --replay (main.json, main.log);
#  3. T1 again with the GIL hand-off yield off (Q6SERVE_HANDOFF_YIELD=0: the A/B of that change;
#     yield0.json);
# with the GPU's SM/memory clocks sampled every 100 ms throughout (clocks.csv, phases.txt). Worker
# and load run in separate processes (bench/service.py starts them). $OUT gets the JSONs, the
# kernel log, a summary table (summary.txt, also printed last) and every log in one archive.
#   bench/gpu_service_run.sh          env: SECONDS_PER_RUN (2), MAIN_ARGS, SKIP_AB=1
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/service_run
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu,power.draw \
  --format=csv,noheader,nounits -lms 100 >"$OUT/clocks.csv" 2>&1 &
SMI=$!
phase() { echo "$1 $(date +%s.%N)" >>"$OUT/phases.txt"; }
S=${SECONDS_PER_RUN:-2}
phase idle_start; sleep 1; phase idle_end
phase kernels_start
timeout 40 python3 bench/kernels.py --shapes 3584x18944 --ns 1 --paths auto --no-torch \
  >"$OUT/kernels.log" 2>&1; echo "# kernels rc=$? ($(elapsed))"
phase kernels_end
phase main_start
# shellcheck disable=SC2086
timeout 170 python3 bench/service.py --backend cuda --target-report --targets T1 \
  --modes stream --weights ffn_down --lm-head --mode stream --replay --seconds "$S" \
  --warmup 0.3 ${MAIN_ARGS:-} --json "$OUT/main.json" >"$OUT/main.log" 2>&1
echo "# main rc=$? ($(elapsed))"
phase main_end
if [[ -z ${SKIP_AB:-} ]]; then
  phase yield0_start
  Q6SERVE_HANDOFF_YIELD=0 timeout 45 python3 bench/service.py --backend cuda --target-report \
    --targets T1 --modes stream --weights ffn_down --seconds "$S" --warmup 0.3 \
    --json "$OUT/yield0.json" >"$OUT/yield0.log" 2>&1
  echo "# yield0 rc=$? ($(elapsed))"
  phase yield0_end
fi
kill "$SMI" 2>/dev/null
grep -E "FAILED|Error|error" "$OUT/main.log" "$OUT/yield0.log" 2>/dev/null | head -5
cp "$OUT"/main.json "$OUT"/yield0.json "$OUT"/kernels.log "$FINAL/" 2>/dev/null
echo "# total $(elapsed)"
python3 bench/service_summary.py run "$OUT" | table
