#!/usr/bin/env bash
# Session 17, helper hp, bundle B (bound 100 s).
# 1. Goal 1, the service's kernel time (bundle A: its graph's events read 29.3 us where
#    bench/kernels.py reads 22.9, at any gap, L2 state or clock): bench/kernel_gap.py's graph
#    variants (the event nodes and the kernel alone, the kernel alone timed by stream events,
#    the start event forked beside the kernel) and the kernels' own CUPTI durations (torch's
#    profiler) of the service's call, the events-only graph and kernels.py's timing; then
#    `svc-fork`, the service's call with Launcher.timing_fork (Q6SERVE_TIMING_FORK=1).
# 2. T1 (bench/service.py --target-report --targets T1) alternated: `def`, `fork`
#    (Q6SERVE_TIMING_FORK=1: the kernel time the service reports, and its p50 - kernel) and `g200`
#    (Q6SERVE_GIL_SWITCH_US=200: goal 3's effect on T1; t1's bundle B runs the replay's A/B of it)
#    as far as the bound allows.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp17b
BOUND=${BOUND:-100}
GIL=${GIL:-200}
step gap 25 python3 bench/kernel_gap.py --smi --calls 300 --gaps 0,spin300 \
  --phases svc,svc-fork,svc-busy,g-kern,g-kern-busy,g-bare,g-bare-busy,g-fork,kpy,cupti \
  --json "$OUT/gap.json"
step tests 15 python3 -m pytest -q -m gpu tests/service/test_launch_split.py -p no:cacheprovider \
  -k timing_fork -rA
t1_run() {  # t1_run RUN NAME
  step "t1_$1" 20 python3 bench/service.py --backend cuda --target-report --targets T1 \
    --modes stream --weights ffn_down --seconds 1.2 --warmup 0.3 --json "$OUT/t1_$1.json"
}
ab_runs 15 t1_run def fork:Q6SERVE_TIMING_FORK=1 "g$GIL:Q6SERVE_GIL_SWITCH_US=$GIL" def \
  fork:Q6SERVE_TIMING_FORK=1 "g$GIL:Q6SERVE_GIL_SWITCH_US=$GIL"
{
  echo "# hp bundle B, tree $(tree_commit), $(elapsed)"
  cut -c1-170 "$OUT/gap.log"
  for f in "$OUT"/t1_*.log; do
    echo "$(basename "$f" .log): $(grep -E '^T1 ' "$f" | tr -s ' ' | cut -c1-150)"
    grep -E "mean us" "$f" | head -1 | tr -s ' '
    grep -E "^# T1 stream" "$f"
  done
  steps
} | table
