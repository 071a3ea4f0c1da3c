#!/usr/bin/env bash
# Session 18, helper hp, bundle A (bound 100 s): the copy-kernel launch sequence
# (Q6SERVE_COPY_KERNEL_MAX / launch.COPY_KERNEL_MAX: x's upload and a small y's download of at
# most that many bytes by a copy kernel on the kernels' engine, no copy-engine node, no timing
# anchor needed). Session 17's bundle C (kernel_gap g-zc) measured the sequence by hand: GPU span
# 40.8 -> 31.1 us, host wall 45.7 -> 36.3 for T1's call.
# 1. bench/backend_wall.py, 3584x18944 f16, N=1 and 64, staged and graph, alternated variants:
#    ce (the copy engine, today), ck64k (copies up to 64 KiB: N=1's x 37 KB and y 14 KB),
#    ckall (every copy that is a kernel's to take: N=64's x 2.4 MB too).
# 2. T1 through gRPC alternated ck (Q6SERVE_COPY_KERNEL_MAX=65536) / def: p50 - kernel, kernel.
# 3. The GPU tests with copy kernels on (y bit for bit on every kind of call, regions too).
# 4. bench/kernel_gap.py with ck: the reply's kernel (events) vs bench/kernels.py (<= 1.25x),
#    the service's graph's GPU span and host wall (g-svc).
# 5. The multi-weight call (q/k/v, gate/up N=1), ce / ck.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp18a
BOUND=${BOUND:-100}
step wall 24 python3 bench/backend_wall.py --shapes 3584x18944 --ns 1,64 --modes staged,graph \
  --calls 300 --rounds 2 --json "$OUT/wall.json" \
  --variants 'ce:COPY_KERNEL_MAX=0;ck64k:COPY_KERNEL_MAX=65536;ckall:COPY_KERNEL_MAX=67108864'
t1_run() {  # t1_run RUN NAME
  step "t1_$1" 14 python3 bench/service.py --backend cuda --target-report --targets T1 \
    --modes stream --weights ffn_down --seconds 1.2 --warmup 0.3 --json "$OUT/t1_$1.json"
}
ab_runs 12 t1_run ck:Q6SERVE_COPY_KERNEL_MAX=65536 def def ck:Q6SERVE_COPY_KERNEL_MAX=65536
Q6SERVE_COPY_KERNEL_MAX=65536 step tests 20 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
  tests/service/test_launch_split.py tests/kernels/test_cuda_backend_host.py \
  tests/dataplane/test_region_call.py tests/dataplane/test_pinned_gpu.py
Q6SERVE_COPY_KERNEL_MAX=65536 step gap 14 python3 bench/kernel_gap.py --calls 300 --gaps 0 \
  --phases svc,g-svc,kpy --json "$OUT/gap.json"
step many 12 python3 bench/backend_wall.py --many qkv,gateup --ns 1 --calls 200 --rounds 2 \
  --variants 'ce:COPY_KERNEL_MAX=0;ck:COPY_KERNEL_MAX=65536' --json "$OUT/many.json"
{
  echo "# hp bundle A, tree $(tree_commit), $(elapsed)"
  grep -E "^# device|^ *3584x18944|^# variants" "$OUT/wall.log" | cut -c1-170
  for f in "$OUT"/t1_*.log; do
    echo "$(basename "$f" .log): $(grep -E '^T1 ' "$f" | tr -s ' ' | cut -c1-150)"
    grep -E "mean us" "$f" | head -1 | tr -s ' '
    grep -E "^# T1 stream" "$f"
  done
  tail -3 "$OUT/tests.log"
  cut -c1-150 "$OUT/gap.log" | grep -v Warning
  grep -A8 "multi-weight summary" "$OUT/many.log"
  steps
} | table
