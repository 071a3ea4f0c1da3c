#!/usr/bin/env bash
# Session 18, helper hp, bundle B (bound 100 s): the copy-kernel sequence on by default
# (launch.COPY_KERNEL_MAX 64 KiB; `ce` = Q6SERVE_COPY_KERNEL_MAX=0, the copy engine as before).
# Bundle A (tree ca37662, bench/gpu_hp_s18a.sh, retired in this commit): 3584x18944 N=1 f16 host
# 30.0 -> 18.0 us staged, 31.6 -> 20.9 fresh x, the kernel 21.5 either way, y equal; the
# reply's kernel 21.98 us vs bench/kernels.py 22.70 (0.97x); T1 through gRPC one ck run 535 us
# against def 508 / 409 (noise); q/k/v in one call 28.6 -> 26.3, gate/up 29.5 -> 32.0 (x only).
# 1. The GPU tests of the region calls (RegionCall's copies by the kernel at the region's device
#    address) and the copy kernel's, with the default.
# 2. bench/backend_wall.py def / ce alternated (N=1, 64; 18944x3584 N=1).
# 3. T1 through gRPC alternated ce / def / def / ce.
# 4. The fast lane, one caller N=1 (RegionCall: goal 2), ce / def.
# 5. The multi-weight call (q/k/v, gate/up N=1), def / ce, 3 rounds.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp18b
BOUND=${BOUND:-100}
step tests 22 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE \
  tests/service/test_launch_split.py tests/dataplane/test_pinned_gpu.py -k "copy_kernel or region or lane"
step wall 14 python3 bench/backend_wall.py --shapes 3584x18944,18944x3584 --ns 1,64 \
  --modes staged,graph --calls 200 --rounds 2 --json "$OUT/wall.json" \
  --variants 'def;ce:COPY_KERNEL_MAX=0'
t1_run() {  # t1_run RUN NAME
  step "t1_$1" 15 python3 bench/service.py --backend cuda --target-report --targets T1 \
    --modes stream --weights ffn_down --seconds 1.2 --warmup 0.3 --json "$OUT/t1_$1.json"
}
ab_runs 12 t1_run ce:Q6SERVE_COPY_KERNEL_MAX=0 def def ce:Q6SERVE_COPY_KERNEL_MAX=0
lane_run() {  # lane_run RUN NAME
  step "lane_$1" 12 python3 bench/lane_latency.py --backend cuda --rows 3584 --k 18944 \
    --paths lane --seconds 1 --warmup 0.3 --json "$OUT/lane_$1.json"
}
ab_runs 9 lane_run def ce:Q6SERVE_COPY_KERNEL_MAX=0
step many 8 python3 bench/backend_wall.py --many qkv,gateup --ns 1 --calls 200 --rounds 3 \
  --variants 'def;ce:COPY_KERNEL_MAX=0' --json "$OUT/many.json"
{
  echo "# hp bundle B, tree $(tree_commit), $(elapsed)"
  grep -cE "PASSED" "$OUT/tests.log" | sed 's/^/tests passed: /'
  grep -E "FAILED|ERROR" "$OUT/tests.log" | head -5
  tail -1 "$OUT/tests.log"
  grep -A12 "^# variants" "$OUT/wall.log" | cut -c1-170
  for f in "$OUT"/t1_*.log; do
    echo "$(basename "$f" .log): $(grep -E '^T1 ' "$f" | tr -s ' ' | cut -c1-150)"
    grep -E "mean us" "$f" | head -1 | tr -s ' '
    grep -E "^# T1 stream" "$f"
  done
  for f in "$OUT"/lane_*.log; do
    echo "$(basename "$f" .log): $(grep -E '^lane' "$f" | tr -s ' ' | cut -c1-160)"
  done
  grep -A4 "multi-weight summary" "$OUT/many.log"
  steps
} | table
