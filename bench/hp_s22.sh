#!/usr/bin/env bash
# Session 22, helper hp (issue 14 goals 0-2); PHASE=a (bundle A, bound 90 s).
# A:
# 0. Goal 2, T1 on what may be a fresh machine (the closing checks' T1 runs first there: session
#    21's read 780 us, re-runs 535/469/392): bench/stream_overhead.py, the bare echo and the CUDA
#    worker (T1's sizes: K=18944 f16 x, 3584 f32 y) alternated over 3 rounds (each round's p50;
#    the way up, the window, the way down by bench/reply_stamps.py), every direct job of the
#    worker stamped by bench/job_stamps.py; the host's load and CPU clocks before and after.
# 1. bench/x_dma_probe.py: x's upload (copy engine, copy kernel) of 512 KiB / 1.8 MB / 3.5 MiB
#    after each of: nothing, an idle wait as long as a fill, the fill, a fill of another
#    buffer, a non-temporal fill (kernels/cuda/hostcopy.py), the fill then 300 us, a
#    write-combined fill: which of dirty lines or idle time slows the upload after a fill.
# 2. bench/backend_wall.py staged and graph at N=64 (4096x14336, 14336x4096): x's fill by
#    NumPy (def) against non-temporal stores from 256 KiB (nt: launch.NT_FILL_MIN), alternated
#    per round, y bit-equal.
# 3. Goal 0: tests/service/test_launch_split.py and tests/kernels/test_cuda_backend_host.py on
#    the GPU (CuPy; main's 2ed3c49, Workspace.y_block's Y_BLOCKS == 0 branch dropped).
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-a}
gpu_session "/tmp/hp22$PHASE"
snap() {  # NAME: the host's load, busiest processes and CPU clocks now, into $OUT/NAME.txt
  { date +%T.%N; top -bn1 -w 160 | head -16
    awk '/MHz/ {s += $4; n++} END {if (n) printf "cpu MHz mean %.0f of %d\n", s / n, n}' \
      /proc/cpuinfo; } >"$OUT/$1.txt" 2>&1
}
if [[ $PHASE == a ]]; then
  BOUND=${BOUND:-90}
  snap host0
  Q6SERVE_JOB_STAMPS="$OUT/js_{pid}.json" step t1so 30 python3 bench/stream_overhead.py \
    --backend cuda --variants bare,worker --rounds 3 --seconds 1 --rows 3584 --out f32 --inproc 0
  snap host1
  step xdma 15 python3 bench/x_dma_probe.py --calls 60 --rounds 3 --json "$OUT/xdma.json"
  step wall 28 python3 bench/backend_wall.py --shapes 4096x14336,14336x4096 --ns 64 \
    --modes staged,graph --calls 150 --rounds 3 --json "$OUT/wall.json" \
    --variants "def;nt:NT_FILL_MIN=262144"
  Q6SERVE_TEST_BACKEND=cuda step tests "$(bound 40 1)" python3 -m pytest -q -rfE \
    -p no:cacheprovider tests/service/test_launch_split.py tests/kernels/test_cuda_backend_host.py
  {
    echo "# hp bundle A, tree $(tree_commit), $(elapsed)"
    grep -E "^# round|^ *(bare|worker) " "$OUT/t1so.log" | cut -c1-200
    python3 bench/job_stamps.py "$OUT"/js_*.json 2>&1 | grep -v "?" | cut -c1-200 | head -12
    grep -h "load average\|^%Cpu\|MHz mean" "$OUT"/host*.txt | cut -c1-120
    cut -c1-120 "$OUT/xdma.log" | grep -v "^#"
    grep -A6 "^# variants" "$OUT/wall.log" | cut -c1-200
    grep -c DIFFERS "$OUT/wall.log" | sed 's/^/rows with y differing: /'
    tail -1 "$OUT/tests.log" 2>/dev/null
    steps
  } | table
fi
exit 0
