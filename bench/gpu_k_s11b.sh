#!/usr/bin/env bash
# Session 11 (issue 16, helper k), second H200 call: the repack probe's GPU tests
# (tests/kernels/test_cuda_pairs.py: probe == plain tile bit for bit at forced slice counts and
# across slabs, the inverse repack round trip), the wgmma tile's tests (its file gained the
# probe), the probe at N = 32/64 (K-slice with the split prefetch, wgmma) on the five shapes of
# call 1 and at N = 1/8/16 on the other five table shapes, and Nsight Compute of one N=32 cell.
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks11b
note "# setup done $(elapsed)"
timeout 70 python3 -m pytest -m gpu -q -rfE --maxfail=3 -p no:cacheprovider tests/kernels/test_cuda_pairs.py \
  >"$OUT/pytest_pairs.log" 2>&1
note "# pairs tests rc=$? $(elapsed)"
tail -4 "$OUT/pytest_pairs.log"
timeout 90 python3 bench/tile_probe.py --rp --shapes 4096x14336,14336x4096,18944x3584,3584x18944,152064x3584 \
  --ns 32,64 --no-torch --json "$OUT/rp_wide.json" >"$OUT/rp_wide.log" 2>&1
note "# rp 32/64 rc=$? $(elapsed)"
sed -n '/repacked-decode probe/,$p' "$OUT/rp_wide.log"
grep -E "FAILED|BAD|BITS DIFFER|Error" "$OUT/rp_wide.log" | head -8
timeout 60 python3 bench/tile_probe.py --rp --shapes 3584x3584,4096x4096,1024x4096,512x3584,128256x4096 \
  --ns 1,8,16 --no-torch --json "$OUT/rp_more.json" >"$OUT/rp_more.log" 2>&1
note "# rp more shapes rc=$? $(elapsed)"
sed -n '/repacked-decode probe/,$p' "$OUT/rp_more.log"
grep -E "FAILED|BAD|BITS DIFFER|Error" "$OUT/rp_more.log" | head -8
timeout 60 python3 -m pytest -m gpu -q -rfE --maxfail=3 -p no:cacheprovider tests/kernels/test_cuda_wg.py \
  >"$OUT/pytest_wg.log" 2>&1
note "# wg tests rc=$? $(elapsed)"
tail -3 "$OUT/pytest_wg.log"
m=smsp__average_warps_issue_stalled
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum
metrics+=,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
for r in long_scoreboard math_pipe_throttle wait not_selected; do
  metrics+=",${m}_${r}_per_issue_active.ratio"; done
timeout 45 ncu --clock-control none -k "regex:q6k_(ksp?|wgp?)_f16" --metrics "$metrics" \
  python3 bench/tile_probe.py --rp --rp-profile --shapes 4096x14336 --ns 32 >"$OUT/ncu_rp32.txt" 2>&1
note "# ncu rc=$? $(elapsed)"
grep -E "q6k_|duration|dram__|inst_executed|issue_active|registers|stalled" "$OUT/ncu_rp32.txt" \
  | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' \
  | awk '{$1=$1};1' | cut -c1-90 | head -70
(cd "$OUT" && tar czf "$FINAL/k_s11b_logs.tgz" -- *)
note "# done $(elapsed)"
