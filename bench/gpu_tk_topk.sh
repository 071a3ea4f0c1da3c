#!/usr/bin/env bash
# Helper tk's GPU session for the top-k epilogue (issue 14 item 4): the epilogue's device-row
# GPU tests (after bench/topk_check_wide.py when WIDE=1), bench/topk_epilogue.py (the group form,
# warm and cold L2; the split form left in session 14), bench/backend_wall.py --topk 64 on the
# lm-head (N=64, staged), then the matmul-level GPU tests; every
# step bounded so that the whole fits BUDGET_S seconds (default 85); logs straight into the
# folder the device tool brings back (at most 8 files), the tables last.
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/tk
LOG=$FINAL
DEADLINE=$((T0 + ${BUDGET_S:-85}))
left() { local l=$((DEADLINE - $(date +%s))); ((l < 1)) && l=1; ((l < $1)) && echo "$l" || echo "$1"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
PYT="python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --maxfail=5"
if [[ ${WIDE:-0} == 1 ]]; then  # N=256 x 152064, k=64, every row against the reference
  CUDA_LAUNCH_BLOCKING=1 timeout "$(left 20)" python3 bench/topk_check_wide.py \
    >>"$LOG/wide.log" 2>&1
  echo "wide check rc=$? $(elapsed)"; grep -v "^ *$" "$LOG/wide.log" | tail -4
fi
timeout "$(left 30)" $PYT tests/kernels/test_epilogue.py -k "special_rows or every_word" \
  >"$LOG/pytest_rows.log" 2>&1
echo "device-row tests rc=$? $(tail -1 "$LOG/pytest_rows.log") $(elapsed)"
timeout "$(left 30)" python3 bench/topk_epilogue.py --iters "${ITERS:-20}" --json "$LOG/topk.json" \
  >"$LOG/topk.log" 2>&1
echo "topk bench rc=$? $(elapsed)"
timeout "$(left 25)" python3 bench/backend_wall.py --shapes 152064x3584 --ns 64 --modes staged \
  --topk 64 --calls 100 >"$LOG/wall.log" 2>&1
echo "backend_wall rc=$? $(elapsed)"
timeout "$(left 300)" $PYT tests/kernels/test_epilogue.py -k "matches_reference" \
  >"$LOG/pytest_mm.log" 2>&1
echo "matmul-level tests rc=$? $(tail -1 "$LOG/pytest_mm.log") $(elapsed)"
grep -hE "^FAILED|^ERROR|Error:" "$LOG"/pytest_*.log | head -20
echo "== backend_wall"; tail -4 "$LOG/wall.log"
cat "$LOG/topk.log"
