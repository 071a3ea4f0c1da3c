#!/usr/bin/env bash
# One GPU session for issue 15: T3's shape through the fast lane (8 hosts x N=64 on ffn_down,
# x and y in each caller's page-locked shm region, no gRPC per call: bench/frontend_cpu.py
# --lane) per variant in VARIANTS, "C:J:P" = C calls in flight per host (callers), J =
# Q6SERVE_JOB_BATCHES, P = Q6SERVE_PIPELINE_SHORT; default "1:1:0 2:1:0 2:4:0": T3 with the
# defaults, then 2 calls in flight per host with one job per batch and with 4 batches to a job
# (session 8: +20-51% there, H200); per front-end count in FRONTENDS (the lane lives in the
# device process); then the GPU tests of tests/dataplane. $OUT gets one archive (after the lane
# runs and at the end).
#   bench/gpu_dataplane_lane.sh   env: SECONDS_PER_RUN (2), VARIANTS, FRONTENDS ("2": a
#   --frontends worker, whose device process pipelines the lanes' full batches since session
#   24, Q6SERVE_DP_LANE_PIPE; "1": a one-process worker's lanes, no such pipeline), SKIP_TESTS
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dataplane_lane
S=${SECONDS_PER_RUN:-2}
for F in ${FRONTENDS:-2}; do
  for v in ${VARIANTS:-1:1:0 2:1:0 2:4:0}; do
    IFS=: read -r C J P <<<"$v"
    tag=lane_f${F}_c${C}_job${J}_pipe$P
    Q6SERVE_JOB_BATCHES=$J Q6SERVE_PIPELINE_SHORT=$P timeout 60 python3 bench/frontend_cpu.py \
      --backend cuda --rows 3584 --k 18944 --n 64 --lane --frontends "$F" --hosts 8 \
      --callers "$C" --seconds "$S" --warmup 0.5 --json "$OUT/$tag.json" >"$OUT/$tag.log" 2>&1
    echo "# $tag rc=$? at $(elapsed): $(tail -1 "$OUT/$tag.log" | cut -c1-300)"
  done
done
archive
if [[ -z ${SKIP_TESTS:-} ]]; then
  timeout "${TESTS_TIMEOUT:-90}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/dataplane >"$OUT/pytest_dataplane_gpu.log" 2>&1
  echo "# gpu tests rc=$? ($(tail -1 "$OUT/pytest_dataplane_gpu.log")) at $(elapsed)"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest_dataplane_gpu.log" | head -8 | cut -c1-240
fi
archive
grep -h "lane:" "$OUT"/lane_*.log | cut -c1-300
echo "# done at $(elapsed)"
