#!/usr/bin/env bash
# Session 22, helper hp (issue 14 goals 0-2); PHASE=a (bundle A, bound 90 s), b (B, 60 s), c (C, 60 s).
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
if [[ $PHASE == b ]]; then  # bundle B (bound 60 s)
  # 1. T1 as the closing check runs it (bench/service.py --target-report, its floors), first on
  #    the machine (a fresh one, if B gets one: the check's first T1 read 780 us, re-runs
  #    535/469/392), the worker's direct jobs and handler windows stamped (bench/job_stamps.py);
  #    again after the wall if the bound leaves time (the second run of the same machine).
  # 2. bench/backend_wall.py N=64/32 staged and graph on the three 48-56 MB shapes: def (this
  #    tree: x's fill non-temporal from 256 KiB, NT_FILL_MIN), old (NumPy's fill: main),
  #    E (def + x's upload by the copy engine past 1 MiB instead of the copy kernel up to 2 MiB:
  #    bundle A's probe read a 1.8 MB upload 49.2 us by the engine after a non-temporal fill
  #    against 70.4 by the kernel), E0 (E with NumPy's fill); alternated per round, y bit-equal.
  BOUND=${BOUND:-60}
  SITE=$PWD/bench/trips_site
  PP=$SITE${PYTHONPATH:+:$PYTHONPATH}
  t1run() {  # NAME SECONDS-LIMIT
    PYTHONPATH=$PP Q6SERVE_JOB_STAMPS="$OUT/js_$1_{pid}.json" step "$1" "$2" python3 \
      bench/service.py --backend cuda --target-report --targets T1 --modes stream \
      --weights ffn_down --seconds 1.2 --warmup 0.3 --json "$OUT/$1.json"
  }
  snap host0
  t1run t1a 26
  snap host1
  step wall 20 python3 bench/backend_wall.py --shapes 4096x14336,14336x4096,3584x18944 \
    --ns 64,32 --modes staged,graph --calls 100 --rounds 3 --json "$OUT/wall.json" \
    --variants "def;old:NT_FILL_MIN=0;E:COPY_KERNEL_MAX=1048576;E0:NT_FILL_MIN=0,COPY_KERNEL_MAX=1048576"
  left 12 && t1run t1b "$(bound 26 1)"
  snap host2
  {
    echo "# hp bundle B, tree $(tree_commit), $(elapsed)"
    for r in t1a t1b; do
      grep -E "^# bare|^T1 |mean us|^# T1 stream" "$OUT/$r.log" 2>/dev/null | cut -c1-170
      python3 bench/job_stamps.py "$OUT"/js_"$r"_*.json 2>&1 | grep -E "all:|^# job stamps|^# handler" | cut -c1-170
    done
    grep -h "load average\|MHz mean" "$OUT"/host*.txt | cut -c1-100
    grep -A12 "^# variants" "$OUT/wall.log" | cut -c1-200
    grep -c DIFFERS "$OUT/wall.log" | sed 's/^/rows with y differing: /'
    steps
  } | table
fi
if [[ $PHASE == c ]]; then  # bundle C (bound 60 s)
  # 1. the closing check's wall (bench/gpu_check.sh wall(): N=1 and 64, graph and staged) on this
  #    tree, x's fill non-temporal from 256 KiB (def) against NumPy's (old), alternated per round
  # 2. goal 2: T1 (the check's command) with the worker unpinned, then pinned to core 2 (its
  #    caller on 8-15: the check's PIN), job stamps in each: does the run-to-run spread of the
  #    worker's parts (B: every part 1.4-1.7x between two runs) follow the worker's placement?
  # 3. the two launcher test files' GPU tests on this tree, if the bound leaves time
  BOUND=${BOUND:-60}
  SITE=$PWD/bench/trips_site
  PP=$SITE${PYTHONPATH:+:$PYTHONPATH}
  t1run() {  # NAME SECONDS-LIMIT [bench/service.py args...]
    local name=$1 limit=$2
    shift 2
    PYTHONPATH=$PP Q6SERVE_JOB_STAMPS="$OUT/js_${name}_{pid}.json" step "$name" "$limit" \
      python3 bench/service.py --backend cuda --target-report --targets T1 --modes stream \
      --weights ffn_down --seconds 1.0 --warmup 0.3 --json "$OUT/$name.json" "$@"
  }
  step wall 16 python3 bench/backend_wall.py --shapes 4096x14336,14336x4096 --ns 1,64 \
    --modes graph,staged --calls 100 --rounds 3 --json "$OUT/wall.json" \
    --variants "def;old:NT_FILL_MIN=0"
  left 14 && t1run t1u "$(bound 20 1)"
  left 10 && t1run t1p "$(bound 16 1)" --pin 2:8-15
  left 10 && step tests "$(bound 30 1)" python3 -m pytest -q -m gpu -rfE -p no:cacheprovider \
    tests/service/test_launch_split.py tests/kernels/test_cuda_backend_host.py
  {
    echo "# hp bundle C, tree $(tree_commit), $(elapsed)"
    grep -A8 "^# variants" "$OUT/wall.log" | cut -c1-200
    grep -c DIFFERS "$OUT/wall.log" | sed 's/^/rows with y differing: /'
    tail -1 "$OUT/tests.log" 2>/dev/null
    for r in t1u t1p; do
      grep -E "^# bare|^T1 |mean us|^# T1 stream" "$OUT/$r.log" 2>/dev/null | cut -c1-170
      python3 bench/job_stamps.py "$OUT"/js_"$r"_*.json 2>&1 | grep -E "all:" | cut -c1-170
    done
    steps
  } | table
fi
exit 0
