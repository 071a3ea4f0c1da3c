#!/usr/bin/env bash
# Issue 15, session 9, call 3: the device process's per-call cost under T2 (64 callers of N=1
# on ffn_down 3584x18944, f16, bytes), main (./base) vs this tree, alternated on one machine:
# this tree runs the calls merged in a loop trip on the engine's direct path with x
# concatenated into the pinned upload buffer, parses plain matmul frames without the message
# tuple and frames the answers from the batch's shared fields. First the direct path's tests
# (the GPU one: merged rows from the pinned staging equal the batch's, through the graph and
# the cached call); then bench/frontend_cpu.py (rows/s, p50/p99, the device process's CPU per
# call over the middle of the timed part) at --frontends 8 and 4, A B B A. A table last.
#   bench/gpu_dataplane_s9c.sh   (./base: main's tree)   env: SECONDS_PER_RUN (1.2)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps9c
base_tree base
S=${SECONDS_PER_RUN:-1.2}
timeout 40 python3 -m pytest -q -rfE -p no:cacheprovider tests/dataplane/test_device_direct.py \
  tests/dataplane/test_device_direct_gpu.py >"$OUT/pytest.log" 2>&1
note "# tests rc=$? at $(elapsed): $(tail -1 "$OUT/pytest.log")"
T2=(--backend cuda --rows 3584 --k 18944 --n 1 --precision f16 --seconds "$S" --warmup 0.3
    --loads 8x8)
v() {  # v TAG PYTHONPATH FRONTENDS
  PYTHONPATH=$2 timeout 45 python3 bench/frontend_cpu.py "${T2[@]}" --frontends "$3" \
    --json "$OUT/fe_$1.json" >"$OUT/fe_$1.log" 2>&1
  note "# $1 rc=$? at $(elapsed): $(grep -h "^frontends=" "$OUT/fe_$1.log" | cut -c1-240)"
  tar czf "$FINAL/dataplane_s9c.tgz" -C "$OUT" .
}
v main_f8 "$BASEPP" 8
v tree_f8 "$NOWPP" 8
v tree_f4 "$NOWPP" 4
v main_f4 "$BASEPP" 4
python3 - "$OUT" <<'PY' | tee "$FINAL/table.txt"
import glob, json, sys
print("# run       rows/s   p50 us   p99 us  device cores  device CPU us/call  rows/batch")
for tag in ("main_f8", "tree_f8", "tree_f4", "main_f4"):
    try:
        r = json.load(open(f"{sys.argv[1]}/fe_{tag}.json"))
    except OSError:
        continue
    print(f"{tag:8} {r['rows_per_s']:>8,.0f} {r['p50_us']:>8,.0f} {r['p99_us']:>8,.0f}"
          f" {r['cpu']['device']:>13.2f} {r['device_cpu_us_per_call']:>19.1f}"
          f" {r['rows_per_batch']:>11.1f}")
PY
tar czf "$FINAL/dataplane_s9c.tgz" -C "$OUT" .
echo "# done at $(elapsed)"
