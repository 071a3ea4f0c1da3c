#!/usr/bin/env bash
# Issue 15, session 11 (helper dp), second device call: a lane plan's copies on streams of
# their own (Q6SERVE_REGION_STREAMS=1: x in on a copy-in stream, y out on a copy-out stream,
# per-slot device buffers, only the kernels on the backend's stream) against the one-stream
# RegionCall (this tree's default), most important first, each step archived as it ends; the
# script skips what would end past BUDGET_S:
# 1. the lane's GPU tests with the copy streams on (test_pinned_gpu.py -k lane);
# 2. T3 through the fast lane (8 hosts x 4 callers of N=64 on ffn_down 3584x18944,
#    bench/frontend_cpu.py --lane), streams / one stream alternated, 2 pairs;
# 3. one caller N=1 on the lane (bench/lane_latency.py --paths lane --check), one pair;
# 4. the device process's parts per pipelined lane call with the streams (device_ipc --parts).
#   bench/gpu_dataplane_s11b.sh   env: SECONDS_PER_RUN (2), BUDGET_S (80)
#   DRY_RUN=1 BACKEND=numpy ROWS=64 K=512 OUT=/tmp/o bench/gpu_dataplane_s11b.sh   (CPU)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps11b
S=${SECONDS_PER_RUN:-2} BUDGET=${BUDGET_S:-80}
BACKEND=${BACKEND:-cuda} ROWS=${ROWS:-3584} K=${K:-18944}  # (a CPU rehearsal: numpy, small)
archive() { tar czf "$FINAL/dataplane_s11b.tgz" -C "$OUT" .; }
left() { (($(date +%s) - T0 + $1 < BUDGET)); }  # left SECONDS: still inside the budget
if [[ -z ${DRY_RUN:-} ]]; then
  Q6SERVE_REGION_STREAMS=1 timeout 40 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/dataplane/test_pinned_gpu.py -k lane >"$OUT/pytest_streams_gpu.log" 2>&1
  note "# gpu test (streams) rc=$? ($(tail -1 "$OUT/pytest_streams_gpu.log")) at $(elapsed)"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest_streams_gpu.log" | head -6 | cut -c1-240
  archive
fi
lane() {  # lane TAG STREAMS
  left 10 || { note "# lane $1 skipped at $(elapsed)"; return; }
  Q6SERVE_REGION_STREAMS=$2 timeout 25 python3 bench/frontend_cpu.py --backend "$BACKEND" \
    --rows "$ROWS" --k "$K" --n 64 --lane --frontends 1 --hosts 8 --callers 4 --seconds "$S" \
    --warmup 0.5 --json "$OUT/lane_$1.json" >"$OUT/lane_$1.log" 2>&1
  note "# lane $1 rc=$? at $(elapsed): $(grep -h "^frontends=" "$OUT/lane_$1.log" | cut -c1-200)"
  archive
}
one() {  # one TAG STREAMS: one caller N=1 on the lane
  left 8 || { note "# one $1 skipped at $(elapsed)"; return; }
  Q6SERVE_REGION_STREAMS=$2 timeout 20 python3 bench/lane_latency.py --backend "$BACKEND" \
    --rows "$ROWS" --k "$K" --paths lane --check --seconds "$S" --warmup 0.3 \
    --json "$OUT/one_$1.json" >"$OUT/one_$1.log" 2>&1
  note "# one $1 rc=$? at $(elapsed): $(grep -hE "^lane|check:" "$OUT/one_$1.log" \
    | cut -c1-200 | tr '\n' ' ')"
  archive
}
lane streams1 1
lane one1 0
lane streams2 1
lane one2 0
one streams 1
one onestream 0
if left 7; then
  Q6SERVE_REGION_STREAMS=1 timeout 15 python3 bench/device_ipc.py --backend "$BACKEND" \
    --rows "$ROWS" --k "$K" --lane --stack 64 --inflight 32 --seconds 1.5 --parts \
    >"$OUT/parts_streams.log" 2>&1
  note "# parts streams rc=$? at $(elapsed)"
fi
python3 bench/dataplane_table.py --lanes "$OUT" | tee "$FINAL/table.txt"
grep -hE "device process|launch_now|flush" "$OUT/parts_streams.log" 2>/dev/null | cut -c1-200
archive
echo "# done at $(elapsed)"
