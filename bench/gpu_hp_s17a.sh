#!/usr/bin/env bash
# Session 17, helper hp, bundle A (bound 100 s).
# 1. Why the service's kernel time (T1's, 3584x18944 N=1 f16: 28.9 us) is longer than
#    bench/kernels.py's (23.0): bench/kernel_gap.py times the same weight and N in one process
#    under each difference (kernels.py's own timing; a kernel launched onto an idle GPU after a
#    host gap, direct or as the service's graph; the graph landing on a busy GPU; rotated copies),
#    with nvidia-smi's SM / memory clocks sampled over each phase.
# 2. T1 itself (bench/service.py --target-report --targets T1), nvidia-smi sampled beside it
#    (the clocks the in-service kernel runs at), alternated with the worker's GIL switch interval
#    at 200 us (Q6SERVE_GIL_SWITCH_US: goal 3, its effect on T1); then the lm-head in one process
#    the same way while the bound allows.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp17a
BOUND=${BOUND:-100}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,power.limit \
  --format=csv >"$OUT/gpu.txt" 2>&1
step gap 45 python3 bench/kernel_gap.py --smi --calls 300 --json "$OUT/gap.json"
smi_bg() {  # smi_bg FILE: nvidia-smi's clocks every 20 ms into FILE until smi_stop
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu \
    --format=csv,noheader,nounits -lms 20 >"$1" 2>/dev/null &
  SMI=$!
}
smi_stop() { kill "$SMI" 2>/dev/null; wait "$SMI" 2>/dev/null; }
t1_run() {  # t1_run RUN NAME
  smi_bg "$OUT/smi_$1.csv"
  step "t1_$1" 25 python3 bench/service.py --backend cuda --target-report --targets T1 \
    --modes stream --weights ffn_down --seconds 2 --warmup 0.3 --json "$OUT/t1_$1.json"
  smi_stop
}
ab_runs 20 t1_run def g200:Q6SERVE_GIL_SWITCH_US=200
lm_run() {  # lm_run RUN NAME
  step "lm_$1" 15 python3 bench/service.py --backend cuda --lm-head --mode stream \
    --seconds 1.2 --warmup 0.3 --json "$OUT/lm_$1.json"
}
ab_runs 12 lm_run g200:Q6SERVE_GIL_SWITCH_US=200 def g200:Q6SERVE_GIL_SWITCH_US=200 def
smi_med() {  # the median SM and memory clock of a T1 run's samples while the GPU was used
  awk -F', *' '$5 > 0 {print $2, $3}' "$1" | sort -n | awk '{a[NR]=$1; b[NR]=$2}
    END {if (NR) printf "sm %d mem %d MHz (%d busy samples)", a[int((NR+1)/2)], b[int((NR+1)/2)], NR}'
}
{
  echo "# hp bundle A, tree $(tree_commit), $(elapsed)"
  cat "$OUT/gpu.txt"
  grep -vE "^#" "$OUT/gap.log" | cut -c1-170
  head -1 "$OUT/gap.log"
  for f in "$OUT"/t1_*.log; do
    r=$(basename "$f" .log)
    echo "$r: $(grep -E '^T1 ' "$f" | tr -s ' ' | cut -c1-150) | $(smi_med "$OUT/smi_${r#t1_}.csv")"
    grep -E "mean us" "$f" | head -1 | tr -s ' '
    grep -E "^# T1 stream" "$f"
  done
  for f in "$OUT"/lm_*.log; do
    echo "$(basename "$f" .log): $(grep -E '^lm-head N=' "$f" | head -1 | tr -s ' ' | cut -c1-150)"
    grep -E "mean us" "$f" | head -1 | tr -s ' '
  done
  steps
} | table
