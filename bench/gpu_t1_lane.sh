#!/usr/bin/env bash
# Issue 15 stretch (helper t1, session 9): the fast lane's single-caller latency, one device
# call, all on one machine. bench/lane_latency.py --backend cuda (ffn_down 3584x18944, N=1 f16
# x, f32 y, one caller, the lane only) with the per-stage breakdown (--stamps: the worker's read,
# job launch and reply write, the caller's write and wake, one clock) and y checked against the
# NumPy reference (--check), alternated over two rounds:
#   main      the base tree $OLD (its code through base_tree's PYTHONPATH), busy polling on
#             (the default on 16 cores) and off (Q6SERVE_BUSY_POLL_US=0)
#   new       this tree: the caller's spin 0 / 250 / 1000 us (client/lane.py) with the worker's
#             busy polling on; spin 0 / 1000 with it off (busy polling off: round 1 only)
# $OUT gets t1lane.tgz, progress.txt and summary.txt.
#   OLD=base bench/gpu_t1_lane.sh          env: SECONDS_PER_RUN (1.0), ROUNDS (2)
#   DRY_RUN=1 BACKEND=numpy ROWS=64 K=512 OLD=/tmp/base OUT=/tmp/o bench/gpu_t1_lane.sh   (CPU)
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1lane  # (DRY_RUN=1: a CPU rehearsal, gpu_lib.sh)
base_tree "${OLD:?set OLD to the base tree}"
S=${SECONDS_PER_RUN:-1.0}
BACKEND=${BACKEND:-cuda}
lane() {  # label tree(old|new) spins [env...]
  local label=$1 pp=$NOWPP spins=$3
  [[ $2 == old ]] && pp=$BASEPP
  shift 3
  (cd bench && PYTHONPATH=$pp env "$@" timeout 45 python3 lane_latency.py --backend "$BACKEND" \
    --rows "${ROWS:-3584}" --k "${K:-18944}" --paths lane --spins "$spins" --stamps --check --seconds "$S" \
    --warmup 0.3 --label "$label" --json "$OUT/$label.json" >"$OUT/$label.log" 2>&1)
  note "# $label rc=$? ($(elapsed))"
  grep -E "^lane|p50 us|check" "$OUT/$label.log" | tee -a "$FINAL/progress.txt"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
  lane "main_on_$r" old ""
  lane "new_on_$r" new 0,250,1000
  ((r > 1)) && continue  # busy polling off: one round (a diagnostic, not an A/B of defaults)
  lane "main_off_$r" old "" Q6SERVE_BUSY_POLL_US=0
  lane "new_off_$r" new 0,1000 Q6SERVE_BUSY_POLL_US=0
done
{
  echo "# gpu_t1_lane now $(cat COMMIT 2>/dev/null) base $(cat "$BASE/COMMIT" 2>/dev/null)" \
    "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)" \
    "$(date -u '+%F %H:%M') UTC, $(elapsed)"
  python3 bench/lane_table.py "$OUT"
} >"$OUT/summary.txt" 2>&1
tar czf "$FINAL/t1lane.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
