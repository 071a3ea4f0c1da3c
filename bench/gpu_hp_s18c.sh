#!/usr/bin/env bash
# Session 18, helper hp, bundle C (bound 60 s): after the copy-kernel default (64 KiB, landed as
# f7b0b5b; bundle B: bench/gpu_hp_s18b.sh at 20e2459).
# 1. Whether the driver maps a registered region (cudaHostRegister, as HostIO pins a lane's
#    region) to a device address, and whether it is the host's (RegionCall's copy kernel needs it).
# 2. bench/backend_wall.py at N=2..16 (x 76-606 KB: over 64 KiB, the copy engine's today) with
#    every x up to 1 MiB by the kernel (ck1m) against the default and the copy engine (ce).
# 3. The fast lane one caller N=1 again, def / ce.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp18c
BOUND=${BOUND:-60}
step map 10 python3 -c "
import numpy as np
from q6serve.kernels.cuda_backend import CudaBackend
be = CudaBackend(0)
buf = np.zeros(1 << 20, np.uint8)
a = buf.ctypes.data
print('pinned', be.hostio.pin(a, buf.nbytes))
d = be.launcher.device_ptr(a)
print('region device address', None if d is None else hex(d), 'host', hex(a), 'same', d == a)
"
step wall 20 python3 bench/backend_wall.py --shapes 3584x18944,4096x14336 --ns 2,4,8,16 \
  --modes staged --calls 200 --rounds 2 --json "$OUT/wall.json" \
  --variants 'def;ck1m:COPY_KERNEL_MAX=1048576;ce:COPY_KERNEL_MAX=0'
lane_run() {  # lane_run RUN NAME
  step "lane_$1" 12 python3 bench/lane_latency.py --backend cuda --rows 3584 --k 18944 \
    --paths lane --seconds 1 --warmup 0.3 --json "$OUT/lane_$1.json"
}
ab_runs 9 lane_run ce:Q6SERVE_COPY_KERNEL_MAX=0 def
{
  echo "# hp bundle C, tree $(tree_commit), $(elapsed)"
  tail -2 "$OUT/map.log"
  grep -A12 "^# variants" "$OUT/wall.log" | cut -c1-170
  for f in "$OUT"/lane_*.log; do
    echo "$(basename "$f" .log): $(grep -E '^lane' "$f" | tr -s ' ' | cut -c1-160)"
  done
  steps
} | table
