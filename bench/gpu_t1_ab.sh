#!/usr/bin/env bash
# Issue 14 A/B on one GPU machine, one device call: a base tree ($BASE, a `git archive` of an
# older commit) against this tree, each installed in turn: the T1 target (bench/service.py
# --target-report: one caller, N=1 f16 ffn_down MatmulStream, with the bare gRPC round trip of
# the same sizes) and the 7B decode replay at S=8 with multi-weight calls; this tree first runs
# its CUDA backend GPU tests, bench/loop_cost.py (what a loop trip costs on this machine) and
# bench/stream_overhead.py --trips over the CUDA worker. $OUT gets t1ab.tgz and summary.txt.
#   BASE=.gpu/base bench/gpu_t1_ab.sh          env: SECONDS_PER_RUN (2)
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1ab
BASE=$(cd "${BASE:?set BASE to the base tree}" && pwd)
HERE=$PWD
S=${SECONDS_PER_RUN:-2}
timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/kernels/test_cuda_backend.py \
  >"$OUT/pytest_backend.log" 2>&1
echo "# backend GPU tests rc=$? ($(elapsed)): $(tail -1 "$OUT/pytest_backend.log")"
python3 bench/loop_cost.py --n 200000 >"$OUT/loop_cost.log" 2>&1
python3 bench/stream_overhead.py --backend cuda --variants bare,servicer,worker --trips \
  --rounds 2 --seconds 1.5 --inproc 0 >"$OUT/overhead_now.log" 2>&1
echo "# overhead ($(elapsed))"
run_tree() {  # label dir
  local label=$1 dir=$2
  python3 -m pip install -q --no-deps --no-build-isolation -e "$dir" >"$OUT/$label.install.log" 2>&1 \
    || { echo "# $label install failed"; return; }
  (cd "$dir" && timeout 60 python3 bench/service.py --backend cuda --target-report --targets T1 \
    --modes stream --weights ffn_down --seconds "$S" >"$OUT/${label}_t1.log" 2>&1)
  echo "# $label T1 rc=$? ($(elapsed))"
  (cd "$dir" && timeout 120 python3 bench/service.py --backend cuda --replay --replay-seqs 8 \
    --multi on --seconds "$S" --warmup 0.3 --json "$OUT/${label}_replay.json" \
    >"$OUT/${label}_replay.log" 2>&1)
  echo "# $label replay rc=$? ($(elapsed))"
}
run_tree base "$BASE"
run_tree now "$HERE"
{
  echo "# gpu_t1_ab base $(cat "$BASE/COMMIT" 2>/dev/null) now $(cat COMMIT 2>/dev/null) $(elapsed)"
  tail -1 "$OUT/pytest_backend.log"
  cat "$OUT/loop_cost.log"
  grep -E "median|loop trips" "$OUT/overhead_now.log"
  for l in base now; do
    echo "## $l"
    grep -E "^T1|mean us|^# T1" "$OUT/${l}_t1.log"
    grep -E "step|S=8" "$OUT/${l}_replay.log" | tail -4
  done
} >"$OUT/summary.txt"
tar czf "$FINAL/t1ab.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
