#!/usr/bin/env bash
# One GPU session for issue 15's page-locked system regions (kernels/hostio.py): the GPU tests
# of tests/dataplane (CUDA IPC regions, page-locked regions: one process and --frontends 2),
# then bench/service.py --dataplane (T2 64 x N=1 and T3 8 hosts x N=64 on ffn_down, bytes and
# shm regions) per VARIANT, alternated on one machine: F:P[:dD] = --frontends F,
# Q6SERVE_PIN_REGIONS=P (1: regions page-locked, x and y DMA'd in place; 0: as before, x staged
# and y copied on the host), optional Q6SERVE_DEFER_KERNEL_US=D. A short table last; $OUT gets
# one archive of every log and JSON.
#   bench/gpu_dataplane_pin.sh   env: SECONDS_PER_RUN (1.5), VARIANTS ("8:1 8:0 4:1 8:1:d0"),
#                                SKIP_TESTS
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dppin
S=${SECONDS_PER_RUN:-1.5}
if [[ -z ${SKIP_TESTS:-} ]]; then
  timeout 150 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/dataplane \
    >"$OUT/pytest_dataplane_gpu.log" 2>&1
  echo "# gpu tests rc=$? ($(tail -1 "$OUT/pytest_dataplane_gpu.log")) at $(elapsed)"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest_dataplane_gpu.log" | head -8 | cut -c1-240
fi
for v in ${VARIANTS:-8:1 8:0 4:1 8:1:d0}; do
  IFS=: read -r F P D <<<"$v"
  D=${D#d}
  tag=f${F}_pin$P${D:+_defer$D}
  Q6SERVE_PIN_REGIONS=$P Q6SERVE_DEFER_KERNEL_US=${D:-200} timeout 80 python3 bench/service.py \
    --backend cuda --dataplane --modes stream --frontends "$F" --t3-hosts 8 --seconds "$S" \
    --warmup 0.3 --json "$OUT/dp_$tag.json" >"$OUT/dp_$tag.log" 2>&1
  echo "# $tag rc=$? at $(elapsed)"
  mv "$OUT/worker.log" "$OUT/worker_$tag.log" 2>/dev/null
done
grep -h "FAILED\|Traceback\|page-lock" "$OUT"/dp_*.log "$OUT"/worker_*.log | sort | uniq -c | head -5
tar czf "$FINAL/dataplane_pin.tgz" -C "$OUT" .
python3 bench/dataplane_table.py "$OUT"  # (its server-side column: srv_other)
echo "# done at $(elapsed)"
