#!/usr/bin/env bash
# Issue 14 T1, session 12 (the lead's bundle A, bound 60 s): split the CUDA worker's request
# step. Session 11 found its loop step taking a request and submitting its reply ~175 us of the
# loop's CPU beyond the handler's window (~45 in the same Worker over a no-op backend), not
# split. One bench/stream_overhead.py run at T1's sizes (K=18944 f16 x, 3584-row f32 y), four
# servers: the echo with the worker's interceptor, decoding, coroutine handler and busy polling
# (the floor of that shape), the same holding each request 200 us, the Worker in process over a
# no-op backend (engine) and the CUDA worker (worker); every server's loop trips counted, with
# the worker's own marks in the request's step (Q6SERVE_STEP_MARKS=1, bench/loop_trips.py:
# decoded, job, job_end, send). Then the CUDA worker again alone, sampled by py-spy --native
# (gRPC's C frames of the read and the write included), summarised by bench/spy_summary.py.
#   bench/gpu_t1_s12.sh         env: ROUNDS (2), SECONDS_PER (1.0), SPLIT_TIMEOUT (32 s),
#                               SPY_SECONDS (4; 0: no profile), RATE (250)
#   a CPU rehearsal: DRY_RUN=1 BACKEND=numpy bench/gpu_t1_s12.sh
# $OUT: t1s12.tgz (logs, trips JSON, profiles), summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1s12
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
ROUNDS=${ROUNDS:-2}
# the spinning echo rung (the floor of T1's shape), the same holding each request 200 us (about
# the CUDA worker's window with its kernel: does a longer window alone lengthen the way up and
# down?), the Worker over a no-op backend, the CUDA worker
VARIANTS=bare+icpt+proto+coro+spin,bare+icpt+proto+coro+spin+hold200,engine,worker
(cd bench && Q6SERVE_STEP_MARKS=1 timeout "${SPLIT_TIMEOUT:-32}" python3 stream_overhead.py --backend "${BACKEND:-cuda}" \
  --inproc 0 --rows 3584 --out f32 --rounds "$ROUNDS" --seconds "${SECONDS_PER:-1.0}" \
  --warmup 0.2 --trips --timeline 6 --variants "$VARIANTS") >"$OUT/split.log" 2>&1
note "# split rc=$? ($(elapsed))"
# then the CUDA worker alone under py-spy --native (no marks: nothing but the profiler added;
# SPY_SECONDS=0: none, e.g. a short validation)
: >"$OUT/spyrun.log"
[[ ${SPY_SECONDS:-4} == 0 ]] || (cd bench && timeout 16 python3 stream_overhead.py --backend "${BACKEND:-cuda}" --inproc 0 \
  --rows 3584 --out f32 --rounds 1 --seconds "${SPY_SECONDS:-4}" --warmup 0.2 \
  --variants worker) >"$OUT/spyrun.log" 2>&1 &
run=$!
while kill -0 "$run" 2>/dev/null && ! grep -q "^# server pids" "$OUT/spyrun.log"; do sleep 0.1; done
pid=$(grep -o " worker=[0-9]*" "$OUT/spyrun.log" | head -1 | cut -d= -f2)
if [[ -n $pid && -x $SPY ]]; then
  timeout 14 "$SPY" record -p "$pid" -d "${SPY_S:-5}" -r "${RATE:-250}" --native -t -f raw \
    -o "$OUT/spy-worker.raw" >"$OUT/spy-worker.log" 2>&1 &
  spy=$!
fi
wait "$run"
note "# spy run rc=$? ($(elapsed))"
[[ -n ${spy:-} ]] && wait "$spy"
{
  echo "# gpu_t1_s12 tree $(cat COMMIT 2>/dev/null) ($(elapsed))"
  grep -E "^# round|^(bare|engine|worker)" "$OUT/split.log" | grep -v "^\s*threads" | cut -c1-330
  grep -E "^worker +median" "$OUT/spyrun.log" | sed 's/^worker /spied  /' | cut -c1-200
  if [[ -s $OUT/spy-worker.raw ]]; then
    echo "## worker: py-spy --native, the loop thread, under MatmulStream"
    python3 bench/spy_summary.py "$OUT/spy-worker.raw" --thread MainThread --under MatmulStream \
      --depth 2 --top 14 | sed -n '/^under/,$p'
  else
    echo "## worker: no profile ($(tail -2 "$OUT/spy-worker.log" 2>/dev/null))"
  fi
} >"$OUT/summary.txt" 2>&1
tar czf "$FINAL/t1s12.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
