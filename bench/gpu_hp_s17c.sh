#!/usr/bin/env bash
# Session 17, helper hp, bundle C (bound 100 s): Q6SERVE_TIMING_ANCHOR, the reported kernel time.
# Bundle B (tree e7a2dbb, bench/gpu_hp_s17b.sh, retired in that commit): the kernel of T1's call
# (3584x18944 N=1 f16) runs 20.2 us by CUPTI whether launched from the service's graph or by
# bench/kernels.py; the service's events read 28.8-29.3, a graph of the events and the kernel
# alone 22.7, kernels.py's stream events 23.1. The start event node after x's upload copy is
# recorded before the copy's hand-off to the kernels' engine. The anchor (an empty kernel between
# the upload and the start event) is meant to move that hand-off before the start event.
# 1. bench/kernel_gap.py: the service's call with and without the anchor, CUPTI beside them;
#    and (for the next session: goal 2) the service's graph against the same sequence with x's
#    upload and y's download done by a copy kernel on the pinned buffers (g-zc: no copy-engine
#    node), their GPU span and host wall per call.
# 2. T1 through gRPC alternated `a1` (Q6SERVE_TIMING_ANCHOR=1: the anchor before the start
#    event) / `def` / `a2` (=2: also one after the end event): the reported kernel p50 and
#    p50 - kernel (the anchors' GPU time is in the call).
# 3. The split-call and host-path GPU tests with both anchors on (y bit for bit on every kind of
#    call: row chunks, token halves, multi-weight, small y in the graph), as far as the bound lets.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp17c
BOUND=${BOUND:-100}
step gap 25 python3 bench/kernel_gap.py --smi --calls 300 --gaps 0,spin300 \
  --phases svc,svc-anchor,svc-anchor2,g-kern,g-up,g-down,g-svc,g-zc,kpy,cupti \
  --json "$OUT/gap.json"
t1_run() {  # t1_run RUN NAME
  step "t1_$1" 18 python3 bench/service.py --backend cuda --target-report --targets T1 \
    --modes stream --weights ffn_down --seconds 1.2 --warmup 0.3 --json "$OUT/t1_$1.json"
}
ab_runs 14 t1_run a1:Q6SERVE_TIMING_ANCHOR=1 def a2:Q6SERVE_TIMING_ANCHOR=2
Q6SERVE_TIMING_ANCHOR=2 step tests 30 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
  tests/service/test_launch_split.py tests/kernels/test_cuda_backend_host.py
ab_runs 14 t1_run a2:Q6SERVE_TIMING_ANCHOR=2 def a1:Q6SERVE_TIMING_ANCHOR=1
{
  echo "# hp bundle C, tree $(tree_commit), $(elapsed)"
  cut -c1-170 "$OUT/gap.log"
  for f in "$OUT"/t1_*.log; do
    echo "$(basename "$f" .log): $(grep -E '^T1 ' "$f" | tr -s ' ' | cut -c1-150)"
    grep -E "mean us" "$f" | head -1 | tr -s ' '
    grep -E "^# T1 stream" "$f"
  done
  tail -3 "$OUT/tests.log"
  steps
} | table
