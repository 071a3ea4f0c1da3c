#!/usr/bin/env bash
# Session 17, helper hp, bundle B (bound 100 s).
# 1. Goal 1, the service's kernel time (bundle A: its graph's events read 29.3 us where
#    bench/kernels.py reads 22.9, at any gap, L2 state or clock): bench/kernel_gap.py's graph
#    variants (the event nodes and the kernel alone, the kernel alone timed by stream events,
#    the start event forked beside the kernel) and the kernels' own CUPTI durations (torch's
#    profiler) of the service's call, the events-only graph and kernels.py's timing; then
#    `svc-fork`, the service's call with Launcher.timing_fork (Q6SERVE_TIMING_FORK=1).
# 2. Goal 3, the worker's GIL switch interval across the paths of one process: the 28-layer
#    decode replay at S = 1 and 8 (multi-weight calls, top-64), two workers in one call
#    (bench/replay_ab.py: `def` Python's 5000 us, `g200` Q6SERVE_GIL_SWITCH_US=200), order
#    def,g200,g200,def.
#    The fork's GPU test (y bit for bit with it, a kernel time) runs after kernel_gap.
# 3. T1 (bench/service.py --target-report --targets T1) with Q6SERVE_TIMING_FORK=1 and without:
#    the kernel time the service reports, and its p50 - kernel.
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
rest=$((BOUND - $(date +%s) + T0 - 36))  # (what the T1 pair after it needs)
step replay "$rest" python3 bench/replay_ab.py --backend cuda \
  --variants "def: g$GIL:Q6SERVE_GIL_SWITCH_US=$GIL" --order "def,g$GIL,g$GIL,def" \
  --seqs 1,8 --seconds 1.2 --warmup 0.3 --bound $((rest - 5)) --out-dir "$OUT" \
  --json "$OUT/replay.json"
t1_run() {  # t1_run RUN NAME
  step "t1_$1" 20 python3 bench/service.py --backend cuda --target-report --targets T1 \
    --modes stream --weights ffn_down --seconds 1.2 --warmup 0.3 --json "$OUT/t1_$1.json"
}
ab_runs 16 t1_run fork:Q6SERVE_TIMING_FORK=1 def fork:Q6SERVE_TIMING_FORK=1 def
{
  echo "# hp bundle B, tree $(tree_commit), $(elapsed)"
  cut -c1-170 "$OUT/gap.log"
  grep -vE "^# (the workers|[0-9]+ workers)" "$OUT/replay.log" | tail -14
  for f in "$OUT"/t1_*.log; do
    echo "$(basename "$f" .log): $(grep -E '^T1 ' "$f" | tr -s ' ' | cut -c1-150)"
    grep -E "mean us" "$f" | head -1 | tr -s ' '
    grep -E "^# T1 stream" "$f"
  done
  steps
} | table
