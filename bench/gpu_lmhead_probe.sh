#!/usr/bin/env bash
# Issue 14 lm-head probe on the GPU machine, one device call: where the worker's host side goes
# per lm-head call (N=64, 8 callers, top-64 on 152064x3584). py-spy samples the worker's threads
# under the lm-head load; then the lm-head target at --frontends 1, 2, 4 (the 458 KB request
# decoded in front-end processes instead of the device process's loop). Logs in $OUT/lmprobe.tgz.
#   bench/gpu_lmhead_probe.sh   (SPY_SECONDS, FRONTENDS="1 2 4", LM_SECONDS to change the spans)
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session "$PWD/lmprobe"
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
python3 bench/service.py --backend cuda --lm-head --mode stream --seconds 14 --warmup 0.3 \
  >"$OUT/spy_run.log" 2>&1 &
bench_pid=$!
for _ in $(seq 90); do
  wpid=$(pgrep -f "q6serve.client.cli worker" | head -1)
  [[ -n $wpid ]] && grep -q "uploaded" "$OUT/spy_run.log" 2>/dev/null && sleep 6 && break
  sleep 1
done
if [[ -n ${wpid:-} ]]; then
  top -H -b -n 2 -d 1 -p "$wpid" >"$OUT/top.txt" 2>&1
  "$SPY" record -p "$wpid" -d "${SPY_SECONDS:-4}" -r 1000 -t -f raw --nonblocking \
    -o "$OUT/worker_spy.raw" >"$OUT/spy.log" 2>&1
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,utilization.gpu --format=csv >"$OUT/clocks.txt"
fi
wait "$bench_pid"
echo "# spy done $(elapsed)"
for fe in ${FRONTENDS:-1 2 4}; do
  timeout 120 python3 bench/service.py --backend cuda --lm-head --mode stream \
    --seconds "${LM_SECONDS:-2}" --warmup 0.3 --frontends "$fe" >"$OUT/lm_fe$fe.log" 2>&1
  echo "# frontends $fe done $(elapsed)"
done
tar czf "$FINAL/lmprobe.tgz" -C "$OUT" .
echo "# all done $(elapsed)"
[[ -f $OUT/worker_spy.raw ]] && python3 bench/spy_summary.py "$OUT/worker_spy.raw" --top 60
grep -A1 -E "^lm-head" "$OUT/spy_run.log" | head -4
grep -E "^%Cpu|python|q6" "$OUT/top.txt" | tail -14
for fe in ${FRONTENDS:-1 2 4}; do echo "== frontends $fe"; grep -A1 -E "^lm-head" "$OUT/lm_fe$fe.log" | head -2; done
