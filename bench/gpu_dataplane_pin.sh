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
python3 - "$OUT" <<'PY'
import glob, json, sys
print("# run               target via     rows/s   p99 us  kernel us  frac | mean us: queue kernel dev_other decode transport")
for path in sorted(glob.glob(f"{sys.argv[1]}/dp_*.json")):
    doc = json.load(open(path))
    tag = path.rsplit("dp_", 1)[1][:-5]
    runs = {r["label"]: r for r in doc["runs"]}
    for t in doc["targets"]:
        rps = t.get("rows_per_s", t.get("service_rows_per_s", 0.0))
        r = next((r for lab, r in runs.items() if lab.startswith(t["target"] + " ")
                  and lab.endswith(" " + (t["region"] or "bytes"))), None)
        pm = (r or {}).get("parts_mean_us", {})
        k = (r or {}).get("kernel_p50_us") or 0
        parts = " ".join(f"{pm.get(p, 0):6.0f}" for p in
                         ("queue", "kernel", "device_other", "server_decode", "transport"))
        print(f"# {tag:17} {t['target']:6} {t['region']:6} {rps:>9,.0f} {t['p99_us']:>8,.0f} "
              f"{k:>9.0f} {t.get('fraction', 0):>5.2f} | {parts}")
PY
echo "# done at $(elapsed)"
