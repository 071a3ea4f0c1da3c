#!/usr/bin/env bash
# One GPU session, T3 with system shm regions only (issue 15): this tree vs OLD (a copy of
# another commit), alternated, per front-end count in FRONTENDS, then the device process of
# this tree profiled under the same load (bench/frontend_cpu.py --profile: counters, per-thread
# CPU, py-spy raw stacks summarized by bench/spy_summary.py), and the page-locked regions' GPU
# tests. A short table last; $OUT gets one archive.
#   OLD=../dp_old bench/gpu_dataplane_t3ab.sh   env: SECONDS_PER_RUN (2), FRONTENDS ("4 8")
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dpt3
S=${SECONDS_PER_RUN:-2}
NEW=$PWD
OLD=${OLD:+$(cd "$OLD" && pwd)}
timeout 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/dataplane/test_pinned_gpu.py \
  >"$OUT/pytest_pinned_gpu.log" 2>&1
echo "# gpu tests rc=$? ($(tail -1 "$OUT/pytest_pinned_gpu.log")) at $(elapsed)"
t3() {  # $1 tag, $2 tree, $3 front ends
  (cd "$2" && timeout 40 python3 bench/service.py --backend cuda --dataplane --targets T3 \
    --regions system --modes stream --frontends "$3" --t3-hosts 8 --seconds "$S" --warmup 0.5 \
    --json "$OUT/t3_$1.json") >"$OUT/t3_$1.log" 2>&1
  echo "# $1 rc=$? at $(elapsed)"
  mv "$OUT/worker.log" "$OUT/worker_$1.log" 2>/dev/null
}
for F in ${FRONTENDS:-4 8}; do
  t3 "new_f$F" "$NEW" "$F"
  if [[ -n $OLD ]]; then
    (cd "$OLD" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1)
    t3 "old_f$F" "$OLD" "$F"
    (cd "$NEW" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1)
  fi
done
timeout 60 python3 bench/frontend_cpu.py --backend cuda --rows 3584 --k 18944 --n 64 \
  --region system --frontends 4 --hosts 8 --callers 1 --seconds 4 --warmup 1 \
  --profile "$OUT/prof" --json "$OUT/prof/result.json" >"$OUT/prof.log" 2>&1
echo "# profile rc=$? at $(elapsed)"; grep -v "^#   per call" "$OUT/prof.log" | tail -4 | cut -c1-250
[[ -f $OUT/prof/pyspy.txt ]] && timeout 30 python3 bench/spy_summary.py "$OUT/prof/pyspy.txt" \
  >"$OUT/prof/summary.txt" 2>&1 && head -40 "$OUT/prof/summary.txt" | cut -c1-160
tar czf "$FINAL/dataplane_t3ab.tgz" -C "$OUT" .
python3 - "$OUT" <<'PY'
import glob, json, sys
print("# run      rows/s  frac   p99 us | mean us: queue kernel dev_other server_other transport")
for path in sorted(glob.glob(f"{sys.argv[1]}/t3_*.json")):
    doc = json.load(open(path))
    r = next(r for r in doc["runs"] if r["label"].startswith("T3 "))
    t = doc["targets"][0]
    pm = r["parts_mean_us"]
    parts = " ".join(f"{pm.get(p, 0):6.0f}" for p in
                     ("queue", "kernel", "device_other", "server_other", "transport"))
    print(f"# {path.split('/t3_')[-1][:-5]:8} {r['rows_per_s']:>8,.0f} {t['fraction']:.3f} "
          f"{r['p99_us']:>8,.0f} | {parts}")
PY
echo "# done at $(elapsed)"
