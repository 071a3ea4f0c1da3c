#!/usr/bin/env bash
# Issue 14 T1 probe on the GPU machine, one device call: where one caller's N=1 MatmulStream
# round trip goes beyond gRPC's own. bench/stream_overhead.py over every variant with the
# CUDA worker and loop-trip counts; then py-spy (sampling the worker's threads) and strace
# (syscalls per round trip) of the CUDA worker under the same closed loop; then the T1 target
# itself (bench/service.py). Logs in $OUT/t1probe.tgz; the tables last.
#   bench/gpu_t1_probe.sh            (ROUNDS, SECONDS_PER, SPY_SECONDS to change the spans)
# LOAD=replay: py-spy/strace the worker under the 7B decode replay (S=8, multi-weight calls)
# instead of T1's closed loop; NATIVE=1: py-spy with native frames (pauses the worker per
# sample: the shares are what counts, not the latencies); OVERHEAD=0 / T1=0 skip those parts.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session "$PWD/t1probe"
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
if [[ ${OVERHEAD:-1} == 1 ]]; then
  python3 bench/stream_overhead.py --backend cuda --trips --rounds "${ROUNDS:-3}" \
    --seconds "${SECONDS_PER:-1.5}" --inproc 3000 >"$OUT/overhead.log" 2>&1
  echo "# overhead done $(elapsed)"
fi
if [[ ${LOAD:-t1} == replay ]]; then
  python3 bench/service.py --backend cuda --replay --replay-seqs 8 --multi on --seconds 20 \
    --warmup 0.3 --no-replay-floor >"$OUT/spy_run.log" 2>&1 &
else
  python3 bench/stream_overhead.py --backend cuda --variants worker --rounds 1 --seconds 12 \
    --inproc 0 >"$OUT/spy_run.log" 2>&1 &
fi
bench_pid=$!
for _ in $(seq 60); do
  wpid=$(pgrep -f "q6serve.client.cli worker" | head -1)
  [[ -n $wpid ]] && grep -q "uploaded" "$OUT/spy_run.log" 2>/dev/null && sleep 3 && break
  [[ -n $wpid && ${LOAD:-t1} != replay ]] && sleep 4 && break
  sleep 1
done
if [[ -n ${wpid:-} ]]; then
  top -H -b -n 2 -d 1 -p "$wpid" >"$OUT/top.txt" 2>&1
  if [[ ${NATIVE:-0} == 1 ]]; then
    "$SPY" record -p "$wpid" -d "${SPY_SECONDS:-3}" -r 200 -t --native -f raw \
      -o "$OUT/worker_spy.raw" >"$OUT/spy.log" 2>&1
  else
    "$SPY" record -p "$wpid" -d "${SPY_SECONDS:-3}" -r 1000 -t -f raw --nonblocking \
      -o "$OUT/worker_spy.raw" >"$OUT/spy.log" 2>&1
  fi
  command -v strace >/dev/null && timeout 3 strace -c -f -p "$wpid" -o "$OUT/strace.txt" \
    >/dev/null 2>&1
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,utilization.gpu --format=csv >"$OUT/clocks.txt"
fi
wait "$bench_pid"
echo "# spy done $(elapsed)"
[[ ${T1:-1} == 1 ]] && timeout 150 python3 bench/service.py --backend cuda --target-report \
  --targets T1 --modes stream --weights ffn_down --seconds 3 >"$OUT/t1.log" 2>&1
tar czf "$FINAL/t1probe.tgz" -C "$OUT" .
echo "# all done $(elapsed)"
tail -3 "$OUT/spy.log"
[[ -f $OUT/worker_spy.raw ]] && python3 bench/spy_summary.py "$OUT/worker_spy.raw" --top 45
grep -E "step|per step" "$OUT/spy_run.log" | head -3
grep -E "T1|mean us" "$OUT/t1.log" 2>/dev/null
tail -16 "$OUT/overhead.log" 2>/dev/null
