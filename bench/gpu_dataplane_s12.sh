#!/usr/bin/env bash
# Issue 15, session 12 (helper dp), bundle A: what bounds T3 through lanes and through CUDA
# regions; most important first, each step archived as it ends; the script skips
# what would end past BUDGET_S:
# 1. the copies' floor: a system-region call's x in (2.4 MB) and y out (0.9 MB) alone on the GPU,
#    page-locked as the regions, and both at once (device_ipc.py --dma);
# 2. T3 through the fast lane (8 hosts x 4 callers of N=64 on ffn_down 3584x18944,
#    bench/frontend_cpu.py --lane): the copy streams' rule (this tree's default: the streams
#    beside a launch in flight) / one stream (Q6SERVE_REGION_STREAMS=0) / three launches in
#    flight (Q6SERVE_LAUNCH_SLOTS=3: x in, kernels and y out of three calls at once), alternated;
# 3. the device process alone on T3's lane shape (device_ipc.py --lane --parts): the rule and
#    three slots, its loop's parts and the full batches per pipeline (flush);
# 4. T3 through lanes over CUDA IPC regions (frontend_cpu.py --lane --region cuda): no x/y DMA;
#    T3 bytes' floor: a bare gRPC echo of T3's message sizes (bench/service_load.py grpc_floor);
# 5. the lane's GPU tests with three slots (test_pinned_gpu.py -k lane).
# ROUND=b (bundle A2): T3 through lanes, the rule and three slots (also with the 32 callers as 32
# load processes), lanes over CUDA regions with and without Q6SERVE_PIPELINE_SHORT=1, each with
# the replies' kernel p50 (T3's fraction as bench/service.py counts it); T3 bytes' echo floor;
# the lane's GPU tests with three slots.
# ROUND=c (bundle A3): the lane's 3 slots by default: T3 through lanes default / =2, the lane's
# GPU tests.
# (T2's timeline with the GC freeze on/off: bench/gpu_dataplane_s11c.sh, bundle B.)
#   bench/gpu_dataplane_s12.sh   env: SECONDS_PER_RUN (2), BUDGET_S (95)
#   DRY_RUN=1 BACKEND=numpy ROWS=64 K=512 OUT=/tmp/o bench/gpu_dataplane_s12.sh   (CPU)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps12
S=${SECONDS_PER_RUN:-2} BUDGET=${BUDGET_S:-95}
BACKEND=${BACKEND:-cuda} ROWS=${ROWS:-3584} K=${K:-18944}  # (a CPU rehearsal: numpy, small)
archive() { tar czf "$FINAL/dataplane_s12.tgz" -C "$OUT" .; }
left() { (($(date +%s) - T0 + $1 < BUDGET)); }  # left SECONDS: still inside the budget
lane() {  # lane TAG ENV [ARGS...]: T3 through lanes under ENV (VAR=VALUE), more ARGS
  local tag=$1 var=$2
  shift 2
  left 10 || { note "# lane $tag skipped at $(elapsed)"; return; }
  env "$var" timeout 25 python3 bench/frontend_cpu.py --backend "$BACKEND" --rows "$ROWS" \
    --k "$K" --n 64 --lane --frontends 1 --hosts 8 --callers 4 --seconds "$S" --warmup 0.5 \
    --json "$OUT/lane_$tag.json" "$@" >"$OUT/lane_$tag.log" 2>&1
  note "# lane $tag rc=$? at $(elapsed): $(grep -h "^frontends=" "$OUT/lane_$tag.log" \
    | cut -c1-220)"
  archive
}
parts() {  # parts TAG ENV: the device process alone on T3's lane shape under ENV
  local tag=$1 var=$2
  left 9 || { note "# parts $tag skipped at $(elapsed)"; return; }
  env "$var" timeout 20 python3 bench/device_ipc.py --backend "$BACKEND" --rows "$ROWS" \
    --k "$K" --lane --stack 64 --inflight 32 --seconds 1.5 --parts \
    --json "$OUT/parts_$tag.json" >"$OUT/parts_$tag.log" 2>&1
  note "# parts $tag rc=$? at $(elapsed): $(grep -h "^device process" "$OUT/parts_$tag.log" \
    | cut -c1-150) $(grep -h "^lane pipelines" "$OUT/parts_$tag.log")"
  archive
}
lane_tests() {  # lane_tests TAG ENV: the lane's GPU tests under ENV (VAR=VALUE)
  if [[ -n ${DRY_RUN:-} ]] || ! left 12; then
    note "# gpu test ($1) skipped at $(elapsed)"
    return
  fi
  env "$2" timeout $((BUDGET + T0 - $(date +%s))) python3 -m pytest -m gpu -q -rfE \
    -p no:cacheprovider tests/dataplane/test_pinned_gpu.py -k lane >"$OUT/pytest_$1_gpu.log" 2>&1
  note "# gpu test ($1) rc=$? ($(tail -1 "$OUT/pytest_$1_gpu.log")) at $(elapsed)"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest_$1_gpu.log" | head -6 | cut -c1-240
}
echo_floor() {  # T3 bytes' floor: one bare gRPC stream round trip of T3's sizes (no worker)
  left 8 || { note "# echo skipped at $(elapsed)"; return; }
  (cd bench && timeout 20 python3 -c "from service_load import grpc_floor
x, y = 64 * $K * 2 + 40, 64 * $ROWS * 4 + 60  # (as bench/service.py's floor: + the fields)
us = grpc_floor(x, y, ['stream'], 2.0)['stream']
print(f'echo {x} B up, {y} B down: p50 {us:,.0f} us; 8 callers x 64 rows at that: '
      f'at most {8 * 64 / us * 1e6:,.0f} rows/s')" >"$OUT/echo_t3.log" 2>&1)
  note "# echo T3 sizes rc=$? at $(elapsed): $(tail -1 "$OUT/echo_t3.log" | cut -c1-160)"
}
if [[ ${ROUND:-a} == c ]]; then  # bundle A3: the new default (3 slots for the lane) validated
  lane default1 Q6SERVE_REGION_STREAMS=1
  lane slots2 Q6SERVE_LAUNCH_SLOTS=2
  lane_tests default Q6SERVE_REGION_STREAMS=1
elif [[ ${ROUND:-a} == b ]]; then  # bundle A2: the slots' T3 with the kernel's own p50
  lane rule1 Q6SERVE_REGION_STREAMS=1
  lane slots3a Q6SERVE_LAUNCH_SLOTS=3
  # lanes over CUDA regions: one request at a time through CudaPlane.start (bundle A: 586k
  # rows/s, the device process at one core), and with PIPELINE_SHORT=1, which launches a
  # busy device's CUDA-region calls behind each other and waits on the device thread
  if [[ $BACKEND == cuda ]]; then
    lane zcuda Q6SERVE_REGION_STREAMS=1 --region cuda
    lane zcudaps Q6SERVE_PIPELINE_SHORT=1 --region cuda
  fi
  # the same 32 callers as 32 load processes of one (bundle A: 8 processes of 4 callers took
  # 1.1-1.2 cores each, their GIL shared by 4 callers' x copies and reply polls)
  lane slots3p32 Q6SERVE_LAUNCH_SLOTS=3 --hosts 32 --callers 1
  echo_floor
  lane_tests slots3 Q6SERVE_LAUNCH_SLOTS=3
else
  if [[ $BACKEND == cuda ]]; then
    timeout 20 python3 bench/device_ipc.py --backend cuda --dma --stack 64 --rows "$ROWS" \
      --k "$K" --json "$OUT/dma.json" >"$OUT/dma.log" 2>&1
    note "# dma rc=$? at $(elapsed): $(grep -h "^dma" "$OUT/dma.log" | cut -c5-80 | tr '\n' ';')"
  fi
  lane rule1 Q6SERVE_REGION_STREAMS=1
  lane one1 Q6SERVE_REGION_STREAMS=0
  lane slots3a Q6SERVE_LAUNCH_SLOTS=3
  parts rule Q6SERVE_REGION_STREAMS=1
  parts slots3 Q6SERVE_LAUNCH_SLOTS=3
  if [[ $BACKEND == cuda ]]; then
    lane zcuda Q6SERVE_REGION_STREAMS=1 --region cuda
  fi
  echo_floor
  lane rule2 Q6SERVE_REGION_STREAMS=1
  lane slots3b Q6SERVE_LAUNCH_SLOTS=3
  lane_tests slots3 Q6SERVE_LAUNCH_SLOTS=3
fi
python3 bench/dataplane_table.py --lanes "$OUT" | tee "$FINAL/table.txt"
for f in "$OUT"/parts_*.log; do
  [[ -f $f ]] || continue
  echo "# $(basename "$f"):"
  grep -hE "loop thread|launch_now|flush|region call|copy streams|_answer|lane read" "$f" \
    | cut -c1-120
done
archive
echo "# done at $(elapsed)"
