#!/usr/bin/env bash
# Issue 14 T1, session 6 (helper t1): one device call, a same-machine A/B within a small device
# budget (~100 s). $BASE: an older tree (a `git archive`), run from its own folder through a
# PYTHONPATH overlay (no second install); this tree is the one installed.
#  1. this tree's CUDA service tests of the direct path
#  2. T1 (bench/service.py --target-report --targets T1 --modes stream --weights ffn_down),
#     base / now alternated twice, then now with Q6SERVE_BUSY_POLL_US=$SPIN (default 200)
#  3. bench/stream_overhead.py --backend cuda --variants worker --trips --timeline: the CUDA
#     worker under one caller's closed loop, with py-spy of it meanwhile (bench/spy_summary.py)
# $OUT gets t1fast.tgz and summary.txt.   BASE=.gpu/t1/base bench/gpu_t1_fast.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1fast
S=${SECONDS_PER_RUN:-1.5}
SPIN=${SPIN:-200}
base_tree "${BASE:?set BASE to the base tree}"
Q6SERVE_TEST_BACKEND=cuda timeout 40 python3 -m pytest -q -rfE -p no:cacheprovider \
  tests/service/test_direct_path.py >"$OUT/pytest_service_cuda.log" 2>&1
note "# service tests on CUDA rc=$? ($(elapsed)): $(tail -1 "$OUT/pytest_service_cuda.log")"
t1() {  # label dir pythonpath [env...]
  local label=$1 dir=$2 pp=$3
  shift 3
  (cd "$dir" && env PYTHONPATH="$pp" "$@" timeout 45 python3 bench/service.py --backend cuda \
    --target-report --targets T1 --modes stream --weights ffn_down --seconds "$S" \
    >"$OUT/t1_$label.log" 2>&1)
  note "# T1 $label rc=$? ($(elapsed)): $(grep -E '^# T1 stream' "$OUT/t1_$label.log")"
  grep -E "mean us" "$OUT/t1_$label.log" >>"$FINAL/progress.txt"
}
t1 base1 "$BASE" "$BASEPP"
t1 now1 "$PWD" "$NOWPP"
t1 base2 "$BASE" "$BASEPP"
t1 now2 "$PWD" "$NOWPP"
t1 spin1 "$PWD" "$NOWPP" Q6SERVE_BUSY_POLL_US="$SPIN"
# the CUDA worker under one caller's closed loop: loop trips, a timeline, and py-spy (1000 Hz,
# not pausing it) for 3 s of it
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
timeout 40 python3 bench/stream_overhead.py --backend cuda --variants worker --trips \
  --timeline 12 --rounds 1 --seconds 6 --inproc 0 >"$OUT/overhead_now.log" 2>&1 &
bench_pid=$!
wpid=$(worker_pid 40)
if [[ -n $wpid ]]; then
  sleep 4
  timeout 10 "$SPY" record -p "$wpid" -d 3 -r 1000 -t -f raw --nonblocking \
    -o "$OUT/worker_spy.raw" >"$OUT/spy.log" 2>&1
  python3 bench/spy_summary.py "$OUT/worker_spy.raw" --top 45 >"$OUT/spy_summary.txt" 2>&1
fi
wait "$bench_pid"
note "# overhead + spy ($(elapsed))"
{
  echo "# gpu_t1_fast base $(cat "$BASE/COMMIT" 2>/dev/null) now $(cat COMMIT 2>/dev/null) $(elapsed)"
  tail -1 "$OUT/pytest_service_cuda.log"
  for l in base1 now1 base2 now2 spin1; do
    echo "## $l"
    grep -E "^T1|mean us|^# T1 stream" "$OUT/t1_$l.log"
  done
  echo "## stream_overhead now (py-spy attached for part of it)"
  grep -vE "^# round" "$OUT/overhead_now.log" | tail -20
  echo "## py-spy of the CUDA worker (one caller, closed loop)"
  head -60 "$OUT/spy_summary.txt" 2>/dev/null
} >"$OUT/summary.txt"
tar czf "$FINAL/t1fast.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
