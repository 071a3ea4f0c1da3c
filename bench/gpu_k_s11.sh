#!/usr/bin/env bash
# Session 11 (issue 16, helper k), one H200 call, most wanted first (each step under its own
# timeout; what is done comes back even if the call is cut):
#  1. the repacked-decode probe (bench/tile_probe.py --rp): q6k_ksp_f16 on repacked copies vs
#     src 4's launch shapes on the SoA weights (same grids, bits compared) beside AUTO;
#  2. (at 324a9f2 only: the K-slice grid model's per-tile charge, tile_probe.py --model-ab, every
#     table shape; the charge lost and was reverted with its --model-ab, so this step is gone)
#  3. Nsight Compute of the probe cell (4096x14336 N=16: AUTO, src 4 and the probe per shape):
#     instructions executed, issue use, the stall mix;
#  4. the K-slice GPU tests (tests/kernels/test_cuda_ks.py).
#   bench/gpu_k_s11.sh        (RP_SHAPES, RP_NS, NCU_SHAPE, NCU_N override)
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks11
note "# setup done $(elapsed)"
SH=${RP_SHAPES:-4096x14336,14336x4096,18944x3584,3584x18944,152064x3584}
timeout "${RP_TIMEOUT:-130}" python3 bench/tile_probe.py --rp --shapes "$SH" --ns "${RP_NS:-1,8,16,64}" \
  --no-torch --json "$OUT/rp.json" >"$OUT/rp.log" 2>&1
note "# rp rc=$? $(elapsed)"
sed -n '/repacked-decode probe/,$p' "$OUT/rp.log"
grep -E "FAILED|BAD|BITS DIFFER|Error" "$OUT/rp.log" | head -8
m=smsp__average_warps_issue_stalled
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum
metrics+=,smsp__inst_executed.avg.per_cycle_active,sm__warps_active.avg.pct_of_peak_sustained_active
metrics+=,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
metrics+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum
for r in long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait not_selected \
    dispatch_stall lg_throttle; do metrics+=",${m}_${r}_per_issue_active.ratio"; done
timeout "${NCU_TIMEOUT:-60}" ncu --clock-control none -k "regex:q6k_ksp?_f16" --metrics "$metrics" \
  python3 bench/tile_probe.py --rp --rp-profile --shapes "${NCU_SHAPE:-4096x14336}" --ns "${NCU_N:-16}" \
  >"$OUT/ncu_rp.txt" 2>&1
note "# ncu rc=$? $(elapsed)"
grep -E "q6k_|duration|dram__|inst_executed|warps_active|issue_active|registers|hmma|local|stalled" \
  "$OUT/ncu_rp.txt" | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' \
  | awk '{$1=$1};1' | cut -c1-100 | head -120
timeout "${KSTEST_TIMEOUT:-70}" python3 -m pytest -m gpu -q -rfE --maxfail=3 -p no:cacheprovider \
  tests/kernels/test_cuda_ks.py >"$OUT/pytest_ks.log" 2>&1
note "# kstest rc=$? $(elapsed)"
tail -4 "$OUT/pytest_ks.log"
(cd "$OUT" && tar czf "$FINAL/k_s11_logs.tgz" -- *)
cp "$OUT"/rp.log "$FINAL"/ 2>/dev/null
note "# done $(elapsed)"
