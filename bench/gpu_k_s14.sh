#!/usr/bin/env bash
# k's bundle-A command (session 14), bounded by CALL_S (145 s):
#   1. bench/kernels.py --cfg-ab: AUTO (the committed table, pair-stream weights, f16
#      activations) against new K-slice launch shapes at N = 32/64, alternated twice in one
#      process, each output compared with AUTO's, torch's f16 linear beside: 8 n-tiles at 12 warps
#      (with / without the register prefetch), 4 n-tiles at 16 warps (two token chunks), and the
#      activations staged by cp.async (xa) at 8 and 12 warps (and at N = 8/16);
#   2. Nsight Compute (--set full) of today's N=64 AUTO tile on 4096x14336 on pair-stream
#      weights (the profile the issue asks for; bench/results' N=64 profiles are of older
#      tiles), then of nt8 at 12 warps and of nt8 with xa;
#   3. the GPU tests of the new shapes (tests/kernels/test_cuda_ks_xa.py).
# Ran in bundle A at tree 83b8f4c (Cfg.xa, the cp.async staging, was removed after it lost:
# bench/results/2026-12-02_k_xa_staging.patch; its candidates fail to parse here).
# Run: `bash bench/gpu_k_s14.sh` from the tree's root (gpu_session installs the wheels).
# CPU rehearsal: DRY_RUN=1 OUT=/tmp/o PATH=$PWD/.venv/bin:$PATH bash bench/gpu_k_s14.sh
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks14
CALL_S=${CALL_S:-145}
left() { echo $((CALL_S - $(date +%s) + T0)); }
bound() { local l; l=$(($(left) - ${2:-0})); ((l < $1)) && echo "$l" || echo "$1"; }
note "# setup done $(elapsed)"
C64="64:nt=8,warps=12,src=4,pf=1;64:nt=8,warps=12,src=4;64:nt=4,warps=16,src=4"
C64+=";64:nt=8,src=4,pf=1,xa=1;64:nt=8,warps=12,src=4,pf=1,xa=1;64:nt=4,warps=12,src=4,pf=1,xa=1"
C32="32:nt=4,warps=16,src=4;32:nt=4,src=4,pf=1,xa=1;32:nt=4,warps=12,src=4,pf=1,xa=1"
C16="16:nt=2,src=4,pf=1,xa=1;16:nt=2,warps=16,src=4,pf=1,xa=1;8:nt=1,src=4,pf=1,xa=1"
SHAPES=${SHAPES:-4096x14336,18944x3584,14336x4096,3584x18944,152064x3584,4096x4096,3584x3584}
t=$(bound 72 62)
timeout "$t" python3 bench/kernels.py --cfg-ab "$C64;$C32;$C16" --rounds 2 --iters 20 \
  --shapes "$SHAPES" --json "$OUT/cfg_ab.json" >"$OUT/cfg_ab.log" 2>&1
note "# cfg-ab rc=$? (bound ${t} s) $(elapsed)"
t=$(bound 42 22)
if command -v ncu >/dev/null; then
  timeout "$t" ncu --clock-control none --set full -k "regex:q6k_(ks|wg)_f16" --launch-count 3 \
    -o "$OUT/ncu64" -f python3 bench/tile_probe.py --profile --no-torch --shapes 4096x14336 \
    --ns 64 --profile-cfgs "64:nt=8,warps=12,src=4,pf=1;64:nt=8,src=4,pf=1,xa=1" \
    >"$OUT/ncu_run.log" 2>&1
  note "# ncu rc=$? (bound ${t} s) $(elapsed)"
  ncu --import "$OUT/ncu64.ncu-rep" --page details >"$OUT/ncu64_details.txt" 2>&1
  ncu --import "$OUT/ncu64.ncu-rep" --page raw --csv >"$OUT/ncu64_raw.csv" 2>&1
else
  note "# ncu: not found"
fi
t=$(bound 40 1)
timeout "$t" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=30 \
  tests/kernels/test_cuda_ks_xa.py >"$OUT/pytest_xa.log" 2>&1
note "# xa tests rc=$? (bound ${t} s) $(elapsed)"
echo "== k bundle A (tree $(cat COMMIT 2>/dev/null || echo '?'))"
echo "pytest_xa: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/pytest_xa.log" 2>/dev/null | tail -1)"
grep -E '^(FAILED|ERROR) ' "$OUT/pytest_xa.log" 2>/dev/null | head -4 | cut -c1-200
echo "# ncu N=64 (AUTO, nt8.w12.pf, nt8.w8.pf.xa): $(grep -E '^ +(Duration|DRAM Throughput|Registers Per Thread|Issue Slots Busy) ' "$OUT/ncu64_details.txt" 2>/dev/null | awk '{$1=$1};1' | head -12 | tr '\n' ';')"
grep -E "FAILED|Error" "$OUT/cfg_ab.log" 2>/dev/null | head -3 | cut -c1-200
echo "# cfg-ab: shape N AUTO-pick us candidate us AUTO/cand rel torch"
grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/cfg_ab.log" 2>/dev/null | awk '{print $1, $2, $3, $4, $5, $6, $7, $8, $9}'
(cd "$OUT" && tar czf "$FINAL/k_s14_logs.tgz" --exclude='*.ncu-rep' -- *)
cp "$OUT"/ncu64.ncu-rep "$FINAL/" 2>/dev/null
note "# done $(elapsed)"
