#!/usr/bin/env bash
# Second GPU session of issue 15, session 8 (short): T3's shape through the fast lane with each
# host keeping 2 calls in flight (bench/frontend_cpu.py --lane --hosts 8 --callers 2, one
# process), one job per batch (today's default) against Q6SERVE_JOB_BATCHES=4, alternated
# twice on one machine; then tests/dataplane/test_pinned_gpu.py (page-locked regions; with
# Q6SERVE_JOB_BATCHES=4 the job path with real launches: results equal the bytes path).
#   bench/gpu_dataplane_s8b.sh   env: SECONDS_PER_RUN (1.5)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps8b
S=${SECONDS_PER_RUN:-1.5}
for round in a b; do
  for j in 1 4; do
    tag=lane2_j${j}_$round
    Q6SERVE_JOB_BATCHES=$j timeout 60 python3 bench/frontend_cpu.py --backend cuda --rows 3584 \
      --k 18944 --n 64 --lane --frontends 1 --hosts 8 --callers 2 --seconds "$S" --warmup 0.5 \
      --json "$OUT/fe_$tag.json" >"$OUT/fe_$tag.log" 2>&1
    note "# $tag rc=$? at $(elapsed): $(grep -h "^frontends=" "$OUT/fe_$tag.log" | cut -c1-260)"
  done
done
tar czf "$FINAL/dataplane_s8b.tgz" -C "$OUT" .
timeout 40 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/dataplane/test_pinned_gpu.py >"$OUT/pytest_pinned_gpu.log" 2>&1
note "# gpu tests rc=$? ($(tail -1 "$OUT/pytest_pinned_gpu.log")) at $(elapsed)"
tar czf "$FINAL/dataplane_s8b.tgz" -C "$OUT" .
echo "# done at $(elapsed)"
