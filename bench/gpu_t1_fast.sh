#!/usr/bin/env bash
# Issue 14 T1, session 6 (helper t1): one device call, a same-machine A/B within a small device
# budget (~100 s). $BASE: an older tree (a `git archive`), run from its own folder through a
# PYTHONPATH overlay (no second install); this tree is the one installed.
#  1. this tree's CUDA service tests of the direct path and MatmulStream
#  2. T1 (bench/service.py --target-report --targets T1 --modes stream --weights ffn_down),
#     base / now alternated twice, then now with Q6SERVE_BUSY_POLL_US=$SPIN (default 200)
#  3. bench/stream_overhead.py --backend cuda: bare echo, the worker over a no-op backend
#     (engine) and the CUDA worker, with loop trips and a timeline; then the CUDA worker
#     again with busy polling
# $OUT gets t1fast.tgz and summary.txt.   BASE=.gpu/t1/base bench/gpu_t1_fast.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1fast
BASE=$(cd "${BASE:?set BASE to the base tree}" && pwd)
S=${SECONDS_PER_RUN:-2}
SPIN=${SPIN:-200}
OVER=/tmp/t1base_path
mkdir -p "$OVER/q6serve"
for d in kernels service client; do ln -sfn "$BASE/$d" "$OVER/q6serve/$d"; done
ln -sfn "$BASE/proto/q6serve/v1" "$OVER/q6serve/v1"
BASEPP="$OVER${PYTHONPATH:+:$PYTHONPATH}"
PYTHONPATH=$BASEPP python3 -c "import q6serve.service.servicer as s; print('# base code', s.__file__)"
Q6SERVE_TEST_BACKEND=cuda timeout 60 python3 -m pytest -q -rfE -p no:cacheprovider \
  tests/service/test_direct_path.py tests/service/test_rpcs.py tests/service/test_busy_poll.py \
  >"$OUT/pytest_service_cuda.log" 2>&1
echo "# service tests on CUDA rc=$? ($(elapsed)): $(tail -1 "$OUT/pytest_service_cuda.log")"
t1() {  # label dir pythonpath [env...]
  local label=$1 dir=$2 pp=$3
  shift 3
  (cd "$dir" && env PYTHONPATH="$pp" "$@" timeout 45 python3 bench/service.py --backend cuda \
    --target-report --targets T1 --modes stream --weights ffn_down --seconds "$S" \
    >"$OUT/t1_$label.log" 2>&1)
  echo "# T1 $label rc=$? ($(elapsed)): $(grep -E '^# T1 stream' "$OUT/t1_$label.log")"
}
NOWPP=${PYTHONPATH:-}
t1 base1 "$BASE" "$BASEPP"
t1 now1 "$PWD" "$NOWPP"
t1 base2 "$BASE" "$BASEPP"
t1 now2 "$PWD" "$NOWPP"
t1 spin1 "$PWD" "$NOWPP" Q6SERVE_BUSY_POLL_US="$SPIN"
t1 spin2 "$PWD" "$NOWPP" Q6SERVE_BUSY_POLL_US="$SPIN"
timeout 50 python3 bench/stream_overhead.py --backend cuda --variants bare,engine,worker --trips \
  --timeline 12 --rounds 2 --seconds 1 --inproc 3000 >"$OUT/overhead_now.log" 2>&1
echo "# overhead ($(elapsed))"
Q6SERVE_BUSY_POLL_US=$SPIN timeout 30 python3 bench/stream_overhead.py --backend cuda \
  --variants bare,worker --trips --rounds 2 --seconds 1 --inproc 0 >"$OUT/overhead_spin.log" 2>&1
echo "# overhead spin ($(elapsed))"
{
  echo "# gpu_t1_fast base $(cat "$BASE/COMMIT" 2>/dev/null) now $(cat COMMIT 2>/dev/null) $(elapsed)"
  tail -1 "$OUT/pytest_service_cuda.log"
  for l in base1 now1 base2 now2 spin1 spin2; do
    echo "## $l"
    grep -E "^T1|mean us|^# T1 stream" "$OUT/t1_$l.log"
  done
  echo "## stream_overhead now"
  grep -vE "^# round" "$OUT/overhead_now.log" | tail -40
  echo "## stream_overhead now, Q6SERVE_BUSY_POLL_US=$SPIN"
  grep -E "median|loop trips" "$OUT/overhead_spin.log"
} >"$OUT/summary.txt"
tar czf "$FINAL/t1fast.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
