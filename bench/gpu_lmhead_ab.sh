#!/usr/bin/env bash
# Issue 14 lm-head A/B on one GPU machine, one device call: the GPU tests of the top-k epilogue and
# of launches in flight (this tree), then the lm-head target (N=64, 8 callers, top-64) for tree A
# and this tree at each --frontends count, alternating. A is a second tree shipped beside this one.
#   A=../main bench/gpu_lmhead_ab.sh     (FRONTENDS="1 4", LM_SECONDS=2, TESTS=0 to skip tests)
set -uo pipefail
cd "$(dirname "$0")/.."
B=$PWD
A=$(cd "${A:?A=path of the other tree}" && pwd)
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session "$PWD/lmab"
if [[ ${TESTS:-1} == 1 ]]; then
  timeout 400 python3 -m pytest -q -m gpu tests/kernels/test_epilogue.py \
    tests/kernels/test_cuda_inflight.py ${EXTRA_TESTS:-} >"$OUT/tests.log" 2>&1
  echo "# tests rc $? $(elapsed)"; tail -2 "$OUT/tests.log"
fi
for fe in ${FRONTENDS:-1 4}; do
  for t in A B; do
    dir=$A; [[ $t == B ]] && dir=$B
    pip install -q --no-deps --no-build-isolation -e "$dir" >"$OUT/pip_$t.log" 2>&1
    (cd "$dir" && timeout 120 python3 bench/service.py --backend cuda --lm-head --mode stream \
      --seconds "${LM_SECONDS:-2}" --warmup 0.3 --frontends "$fe") >"$OUT/lm_${t}_fe$fe.log" 2>&1
    echo "# $t frontends $fe done $(elapsed)"
  done
done
tar czf "$FINAL/lmab.tgz" -C "$OUT" .
for fe in ${FRONTENDS:-1 4}; do for t in A B; do
  d=$A; [[ $t == B ]] && d=$B; echo "== $t ($(cat "$d/COMMIT" 2>/dev/null)) frontends $fe"
  grep -A1 -E "^lm-head" "$OUT/lm_${t}_fe$fe.log" | head -2
done; done
