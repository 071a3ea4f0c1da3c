#!/usr/bin/env bash
# k's add-on to the closing check (session 15), bounded by CALL_S (58 s), run in main's tree:
#   1. the landing check of the table's src 7 cells (14336x4096 and 3584x3584 at N = 8/16, auto
#      and f16: the K-slice tile with its split-K sum inside a thread-block cluster, at the launch
#      shape and K split the cells had): bench/kernels.py --table-ab against the table main had
#      before (bench/results/2026-12-02_dispatch_h200_76aee41.json), old/new alternated, bits
#      compared;
#   2. Nsight Compute (--set full) of AUTO's tiles and split-K sums (not the load kernels) on
#      3584x3584 (11 MB) and 18944x3584 (56 MB) at N = 16 and 64: the missed cells' profiles.
# Run: `bash bench/gpu_k_s15c.sh` from the tree's root (gpu_session installs the wheels;
# SKIP_INSTALL=1 where the closing check installed them already).
set -uo pipefail
source bench/gpu_lib.sh
if [[ -n ${SKIP_INSTALL:-} ]]; then
  FINAL=${OUT:-$PWD/out}; OUT=/tmp/ks15c; rm -rf "$OUT"; mkdir -p "$FINAL" "$OUT"
  T0=$(date +%s); [[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site
else
  gpu_session /tmp/ks15c
fi
CALL_S=${CALL_S:-58}
left() { echo $((CALL_S - $(date +%s) + T0)); }
bound() { local l; l=$(($(left) - ${2:-0})); ((l < $1)) && echo "$l" || echo "$1"; }
note "# k add-on setup done $(elapsed)"
t=$(bound 22 30)
timeout "$t" python3 bench/kernels.py --table-ab bench/results/2026-12-02_dispatch_h200_76aee41.json \
  --columns auto,f16 --iters 40 --shapes 14336x4096,3584x3584 --ns 8,16 \
  --json "$OUT/table_ab.json" >"$OUT/table_ab.log" 2>&1
note "# table-ab rc=$? (bound ${t} s) $(elapsed)"
t=$(bound 32 2)
if command -v ncu >/dev/null && ((t > 10)); then
  timeout "$t" ncu --clock-control none --set full -k "regex:q6k_(ks|ksc|ksr|mma|wg)_f16|q6k_sum_parts" \
    -o "$OUT/ncu_auto" -f python3 bench/tile_probe.py --profile --no-torch \
    --shapes 3584x3584,18944x3584 --ns 16,64 --profile-cfgs "" >"$OUT/ncu_auto_run.log" 2>&1
  note "# ncu rc=$? (bound ${t} s) $(elapsed)"
  ncu --import "$OUT/ncu_auto.ncu-rep" --page details >"$OUT/ncu_auto_details.txt" 2>&1
  rm -f "$OUT"/*.ncu-rep
fi
echo "== k closing add-on (tree $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null))"
echo "# table-ab: shape N column old-pick us new-pick us TB/s old/new"
grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/table_ab.log" 2>/dev/null | awk '{print $1, $2, $3, $4, $5, $6, $7, $8, $9}'
grep -iE "differ|bits|Error" "$OUT/table_ab.log" 2>/dev/null | head -4 | cut -c1-200
echo "# ncu AUTO (kernel grid: us, DRAM %, SM busy %, issue %, regs, achieved occ %)"
grep -E "^  [a-z].*\(|^    (Duration|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Registers Per Thread|Achieved Occupancy) " \
  "$OUT/ncu_auto_details.txt" 2>/dev/null | sed -E 's/\(const unsigned.*\) \(/(/; s/, Context.*//' | awk '{$1=$1};1' | cut -c1-110
(cd "$OUT" && tar czf "$FINAL/k_s15c_logs.tgz" -- *)
note "# k add-on done $(elapsed)"
