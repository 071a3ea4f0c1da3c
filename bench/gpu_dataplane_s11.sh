#!/usr/bin/env bash
# Issue 15, session 11 (helper dp), one device call: the lane's region plans (a repeated lane
# request = the backend's RegionCall, one graph launch) against BASE (main without them,
# imported ahead of the install: gpu_lib.sh base_tree), most important first, each step
# archived into $FINAL as it ends; the script skips what would end past BUDGET_S:
# 1. the GPU tests of the lane on page-locked regions (test_pinned_gpu.py -k lane: T3's shape
#    pipelined with plans; test_lane_plans_replay_one_graph: y against the bytes path, f32/f16,
#    full and lone, stale after an unpin);
# 2. T3 through the fast lane (8 hosts x 4 callers of N=64 on ffn_down 3584x18944, x and y in
#    each caller's page-locked region, bench/frontend_cpu.py --lane), this tree / BASE
#    alternated, 2 pairs;
# 3. one caller N=1 on the lane (bench/lane_latency.py --paths lane --check): p50 - kernel,
#    this tree / BASE alternated, 2 pairs;
# 4. the device process's parts per pipelined lane call on the H200 (bench/device_ipc.py
#    --backend cuda --lane --parts), this tree then BASE.
# A short table last.
#   BASE=base bench/gpu_dataplane_s11.sh   env: SECONDS_PER_RUN (2), BUDGET_S (150)
#   DRY_RUN=1 BACKEND=numpy ROWS=64 K=512 BASE=/tmp/base OUT=/tmp/o bench/gpu_dataplane_s11.sh
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps11
S=${SECONDS_PER_RUN:-2} BUDGET=${BUDGET_S:-150}
BACKEND=${BACKEND:-cuda} ROWS=${ROWS:-3584} K=${K:-18944}  # (a CPU rehearsal: numpy, small)
base_tree "${BASE:-base}"
archive() { tar czf "$FINAL/dataplane_s11.tgz" -C "$OUT" .; }
left() { (($(date +%s) - T0 + $1 < BUDGET)); }  # left SECONDS: still inside the budget
if [[ -z ${DRY_RUN:-} ]]; then
  timeout 50 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/dataplane/test_pinned_gpu.py -k lane >"$OUT/pytest_lane_gpu.log" 2>&1
  note "# gpu test rc=$? ($(tail -1 "$OUT/pytest_lane_gpu.log")) at $(elapsed)"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest_lane_gpu.log" | head -6 | cut -c1-240
  archive
fi
lane() {  # lane TAG PYTHONPATH
  left 14 || { note "# lane $1 skipped at $(elapsed)"; return; }
  PYTHONPATH="$2" timeout 30 python3 bench/frontend_cpu.py --backend "$BACKEND" --rows "$ROWS" \
    --k "$K" --n 64 --lane --frontends 1 --hosts 8 --callers 4 --seconds "$S" --warmup 0.5 \
    --json "$OUT/lane_$1.json" >"$OUT/lane_$1.log" 2>&1
  note "# lane $1 rc=$? at $(elapsed): $(grep -h "^frontends=" "$OUT/lane_$1.log" | cut -c1-200)"
  archive
}
one() {  # one TAG PYTHONPATH: one caller N=1 on the lane
  left 12 || { note "# one $1 skipped at $(elapsed)"; return; }
  PYTHONPATH="$2" timeout 30 python3 bench/lane_latency.py --backend "$BACKEND" --rows "$ROWS" \
    --k "$K" --paths lane --check --seconds "$S" --warmup 0.3 --json "$OUT/one_$1.json" \
    >"$OUT/one_$1.log" 2>&1
  note "# one $1 rc=$? at $(elapsed): $(grep -hE "^lane|check:" "$OUT/one_$1.log" \
    | cut -c1-200 | tr '\n' ' ')"
  archive
}
parts() {  # parts TAG PYTHONPATH: the device process alone, per pipelined lane call
  left 12 || { note "# parts $1 skipped at $(elapsed)"; return; }
  PYTHONPATH="$2" timeout 25 python3 bench/device_ipc.py --backend "$BACKEND" --rows "$ROWS" \
    --k "$K" --lane --stack 64 --inflight 32 --seconds 2 --parts >"$OUT/parts_$1.log" 2>&1
  note "# parts $1 rc=$? at $(elapsed)"
  archive
}
lane new1 "$NOWPP"
lane base1 "$BASEPP"
lane new2 "$NOWPP"
lane base2 "$BASEPP"
one new1 "$NOWPP"
one base1 "$BASEPP"
one new2 "$NOWPP"
one base2 "$BASEPP"
parts new "$NOWPP"
parts base "$BASEPP"
python3 bench/dataplane_table.py --lanes "$OUT" | tee "$FINAL/table.txt"
grep -hE "^lane|check:" "$OUT"/one_*.log 2>/dev/null | cut -c1-200
for f in "$OUT"/parts_*.log; do
  [[ -f $f ]] && { echo "## $(basename "$f")"; grep -E "device process|loop thread|launch|flush" \
    "$f" | cut -c1-200; }
done
archive
echo "# done at $(elapsed)"
