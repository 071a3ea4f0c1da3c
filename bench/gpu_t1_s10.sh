#!/usr/bin/env bash
# Issue 14, session 10 (the worker's per-request Python): one GPU machine, one device call.
# This tree's service GPU tests of what changed (the CUDA backend through the worker: direct
# path, replies, metrics), then T1 (bench/service.py --target-report: one caller, N=1
# f16 ffn_down MatmulStream, with the bare gRPC floor of the same sizes) for a base tree and
# this one, alternated PAIRS times (H200 hosts differ up to 1.6x between calls: only this
# machine's pairs are compared). The base runs through PYTHONPATH (gpu_lib.sh base_tree), the
# same bench script for both. REPLAY=1 adds the 7B replay at S=1 and S=8 once per tree.
# $OUT gets summary.txt and t1s10.tgz (every log); progress.txt as it goes.
#   BASE=base bench/gpu_t1_s10.sh      env: PAIRS (3), SECONDS_PER_RUN (1.5), TEST_TIMEOUT (60)
#   a CPU rehearsal: DRY_RUN=1 BACKEND=numpy PAIRS=1 BASE=... bench/gpu_t1_s10.sh
# MODE=overhead: instead of T1, bench/stream_overhead.py's worker against the bare echo in
# ROUNDS (5) alternated rounds per run (the floor measured beside it, in the same process).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1s10
base_tree "${BASE:?set BASE to the base tree}"
S=${SECONDS_PER_RUN:-1.5}
BACKEND=${BACKEND:-cuda}
Q6SERVE_TEST_BACKEND=$BACKEND timeout "${TEST_TIMEOUT:-60}" python3 -m pytest -q -x -p no:cacheprovider \
  tests/service/test_direct_path.py tests/service/test_wire_replies.py \
  tests/service/test_metrics.py >"$OUT/pytest_cuda.log" 2>&1
note "# service CUDA tests rc=$? ($(elapsed)): $(tail -1 "$OUT/pytest_cuda.log")"
t1() {  # label PYTHONPATH
  PYTHONPATH=$2 python3 -c "import q6serve.service as s; print('# code', s.__file__)" >"$OUT/$1.code"
  PYTHONPATH=$2 timeout 60 python3 bench/service.py --backend "$BACKEND" --target-report --targets T1 \
    --modes stream --weights ffn_down --seconds "$S" --warmup 0.3 >"$OUT/$1.log" 2>&1
  note "# $1 rc=$? ($(elapsed)): $(grep -E '^# T1 stream' "$OUT/$1.log" | cut -c1-100)"
}
overhead() {  # label PYTHONPATH: bench/stream_overhead.py, the worker against the bare echo
  # in alternated rounds within one run (T1's sizes: a round's "worker - bare" is the figure)
  PYTHONPATH=$2 timeout 60 python3 bench/stream_overhead.py --backend "$BACKEND"     --variants bare,worker --rounds "${ROUNDS:-5}" --seconds 1 --warmup 0.2 --inproc 0     --rows 3584 --out f32 >"$OUT/ovh_$1.log" 2>&1
  note "# overhead $1 rc=$? ($(elapsed)): $(grep -E '^worker ' "$OUT/ovh_$1.log" | cut -c1-150)"
}
for ((i = 1; i <= ${PAIRS:-3}; i++)); do
  if [[ ${MODE:-t1} == overhead ]]; then
    if ((i % 2)); then overhead "base$i" "$BASEPP"; overhead "now$i" "$NOWPP"
    else overhead "now$i" "$NOWPP"; overhead "base$i" "$BASEPP"; fi
  elif ((i % 2)); then t1 "base$i" "$BASEPP"; t1 "now$i" "$NOWPP"
  else t1 "now$i" "$NOWPP"; t1 "base$i" "$BASEPP"; fi
done
if [[ -n ${REPLAY:-} ]]; then
  for l in base now; do
    pp=$NOWPP; [[ $l == base ]] && pp=$BASEPP
    PYTHONPATH=$pp timeout 120 python3 bench/service.py --backend "$BACKEND" --replay --replay-seqs 1,8 \
      --seconds "$S" --warmup 0.3 >"$OUT/${l}_replay.log" 2>&1
    note "# $l replay rc=$? ($(elapsed))"
  done
fi
{
  echo "# gpu_t1_s10 base $(cat "$BASE/COMMIT" 2>/dev/null) now $(cat COMMIT 2>/dev/null) $(elapsed)"
  tail -1 "$OUT/pytest_cuda.log"
  python3 bench/t1_table.py "$OUT" base now
  grep -hE "^# overhead" "$FINAL/progress.txt" 2>/dev/null
  for l in base now; do
    [[ -f $OUT/${l}_replay.log ]] && { echo "## $l replay"; grep -E "step|S=" "$OUT/${l}_replay.log" | tail -4; }
  done
} >"$OUT/summary.txt" 2>&1
tar czf "$FINAL/t1s10.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
