#!/usr/bin/env bash
# Issue 14 T1, session 12 (the lead's bundle A, bound 60 s): split the CUDA worker's request
# step. Session 11 found its loop step taking a request and submitting its reply ~175 us of the
# loop's CPU beyond the handler's window (~45 in the same Worker over a no-op backend), not
# split. One bench/stream_overhead.py run at T1's sizes (K=18944 f16 x, 3584-row f32 y), three
# servers: the echo with the worker's interceptor, decoding, coroutine handler and busy polling
# (the floor of that shape), the Worker in process over a no-op backend (engine) and the CUDA
# worker (worker); every server's loop trips counted with the worker's own marks in the
# request's step (Q6SERVE_STEP_MARKS=1, bench/loop_trips.py: decoded, job, job_end, send);
# in the last round py-spy --native samples the engine's and the worker's processes (the C
# frames of gRPC's read and write included), summarised by bench/spy_summary.py.
#   bench/gpu_t1_s12.sh         env: ROUNDS (3), SECONDS_PER (1.2), RATE (400)
#   a CPU rehearsal: DRY_RUN=1 BACKEND=numpy bench/gpu_t1_s12.sh
# $OUT: t1s12.tgz (logs, trips JSON, profiles), summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1s12
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
ROUNDS=${ROUNDS:-3}
VARIANTS=bare+icpt+proto+coro+spin,engine,worker
(cd bench && Q6SERVE_STEP_MARKS=1 timeout 42 python3 stream_overhead.py --backend "${BACKEND:-cuda}" \
  --inproc 0 --rows 3584 --out f32 --rounds "$ROUNDS" --seconds "${SECONDS_PER:-1.2}" \
  --warmup 0.2 --trips --timeline 6 --variants "$VARIANTS") >"$OUT/split.log" 2>&1 &
run=$!
# the last round: both servers sampled (the rounds before stay unperturbed)
while kill -0 "$run" 2>/dev/null && ! grep -q "^# round $((ROUNDS - 1)):" "$OUT/split.log"; do
  sleep 0.1
done
note "# round $((ROUNDS - 1)) done ($(elapsed)); $(grep '^# server pids' "$OUT/split.log")"
spies=()
for v in engine worker; do
  pid=$(grep -o " $v=[0-9]*" "$OUT/split.log" | head -1 | cut -d= -f2)
  if [[ -n $pid && -x $SPY ]] && kill -0 "$run" 2>/dev/null; then
    timeout 15 "$SPY" record -p "$pid" -d "${SPY_S:-5}" -r "${RATE:-400}" --native -t -f raw \
      -o "$OUT/spy-$v.raw" >"$OUT/spy-$v.log" 2>&1 &
    spies+=($!)
  fi
done
wait "$run"
note "# split rc=$? ($(elapsed))"
for p in "${spies[@]}"; do wait "$p"; done
{
  echo "# gpu_t1_s12 tree $(cat COMMIT 2>/dev/null) ($(elapsed))"
  grep -E "^# round|^(bare|engine|worker)" "$OUT/split.log" | grep -v "^\s*threads" | cut -c1-330
  for v in engine worker; do
    [[ -s $OUT/spy-$v.raw ]] || { echo "## $v: no profile ($(tail -2 "$OUT/spy-$v.log" 2>/dev/null))"; continue; }
    echo "## $v: py-spy --native, the loop thread, under MatmulStream"
    python3 bench/spy_summary.py "$OUT/spy-$v.raw" --thread MainThread --under MatmulStream \
      --depth 2 --top 14 | sed -n '/^under/,$p'
  done
} >"$OUT/summary.txt" 2>&1
tar czf "$FINAL/t1s12.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
