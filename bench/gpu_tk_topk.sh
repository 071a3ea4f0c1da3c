#!/usr/bin/env bash
# Helper tk's GPU session for the top-k epilogue (issue 14 item 4): the epilogue's own GPU tests
# (device rows first, then through CudaBackend.matmul), bench/topk_epilogue.py (split vs groups,
# warm and cold L2) and bench/backend_wall.py --topk 64 on the lm-head with each form; logs in
# $FINAL/tk.tgz, the tables last.   TESTS_S: seconds for the matmul-level tests (default 45).
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/tk
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
PYT="python3 -m pytest -m gpu -q -rfE -p no:cacheprovider --maxfail=5"
timeout 60 $PYT tests/kernels/test_epilogue.py -k "special_rows or every_word" \
  >"$OUT/pytest_rows.log" 2>&1; echo "device-row tests rc=$? $(tail -1 "$OUT/pytest_rows.log") $(elapsed)"
timeout 60 python3 bench/topk_epilogue.py --iters ${ITERS:-30} --json "$OUT/topk.json" \
  >"$OUT/topk.log" 2>&1; echo "topk bench rc=$? $(elapsed)"
for form in split groups; do
  timeout 45 python3 - "$form" >"$OUT/wall_$form.log" 2>&1 <<'PY'
import runpy, sys
from q6serve.kernels import cuda_topk
cuda_topk.KERNELS = sys.argv[1]
mod = runpy.run_path("bench/backend_wall.py")
mod["main"](["--shapes", "152064x3584", "--ns", "64", "--modes", "staged", "--topk", "64",
             "--calls", "100"])
PY
  echo "backend_wall $form rc=$? $(elapsed)"
done
timeout "${TESTS_S:-45}" $PYT tests/kernels/test_epilogue.py -k "matches_reference" \
  >"$OUT/pytest_mm.log" 2>&1; echo "matmul-level tests rc=$? $(tail -1 "$OUT/pytest_mm.log") $(elapsed)"
grep -E "FAILED|Error|assert" "$OUT"/pytest_*.log | head -20
tar czf "$FINAL/tk.tgz" -C "$OUT" .
for form in split groups; do echo "== backend_wall ($form)"; tail -4 "$OUT/wall_$form.log"; done
cat "$OUT/topk.log"
