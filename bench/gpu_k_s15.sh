#!/usr/bin/env bash
# k's bundle-A command (session 15), bounded by CALL_S (105 s):
#   1. GPU tests: what issue 16 item 2's removal touched (tests/kernels/test_cuda_wg.py: the
#      wgmma tile, now 8 n-tiles only, at 1/2/3 warpgroups; the pair-stream tests that run the
#      wgmma tile and the f16 tile src 2/3, now without the register prefetch) and the
#      experiment's tile (tests/kernels/test_cuda_ksc.py: src 7 bit-identical to src 4);
#   2. the experiment: --cfg-ab of src 7 (q6k_ksc_f16: the K-slice tile with its split-K sum
#      inside a thread-block cluster of its K slices, no q6k_sum_parts launch) at AUTO's own
#      launch shapes and K splits (rel 0 = AUTO's bits) on the 48-56 MB shapes and 3584x3584,
#      N = 8, 16, 32, 64 (a candidate whose K does not cut into its cluster size is reported
#      FAILED and skipped);
#   3. Nsight Compute (--set full) of AUTO on missed cells not profiled before: 18944x3584
#      (56 MB) and 3584x3584 (11 MB) at N = 16, 64, with their split-K sums;
#   4. Nsight Compute of torch's f16 linear (cuBLAS) on 3584x3584 and 18944x3584 at N=64
#      (weights copied from the host: the linear's are the only kernels).
# Run: `bash bench/gpu_k_s15.sh` from the tree's root (gpu_session installs the wheels).
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks15
CALL_S=${CALL_S:-105}
left() { echo $((CALL_S - $(date +%s) + T0)); }
bound() { local l; l=$(($(left) - ${2:-0})); ((l < $1)) && echo "$l" || echo "$1"; }
note "# setup done $(elapsed)"
t=$(bound 40 60)
timeout "$t" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=40 \
  tests/kernels/test_cuda_wg.py tests/kernels/test_cuda_pairs.py tests/kernels/test_cuda_ksc.py \
  -k "test_every or other_paths or auto_through or zero_and_extreme or agrees or wg or ksc" \
  >"$OUT/pytest.log" 2>&1
note "# tests rc=$? (bound ${t} s) $(elapsed)"
C8="8:nt=1,src=7,pf=1,ksplit=8;8:nt=1,src=7,pf=1,ksplit=7;8:nt=1,src=7,pf=1,ksplit=2"
C8+=";8:nt=1,warps=16,src=7,pf=1,ksplit=8"
C16="16:nt=2,warps=16,src=7,pf=1,ksplit=8;16:nt=2,warps=16,src=7,pf=1,ksplit=2"
C16+=";16:nt=2,src=7,pf=1,ksplit=7"
C64="64:nt=8,src=7,pf=1,ksplit=4"
t=$(bound 25 35)
timeout "$t" python3 bench/kernels.py --cfg-ab "$C8;$C16;$C64" --rounds 2 --iters 20 \
  --shapes 4096x14336,14336x4096,18944x3584,3584x3584 \
  --json "$OUT/cfg_ab_ksc.json" >"$OUT/cfg_ab_ksc.log" 2>&1
note "# cfg-ab ksc rc=$? (bound ${t} s) $(elapsed)"
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg,gpc__cycles_elapsed.max,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__throughput.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio
t=$(bound 22 13)
if command -v ncu >/dev/null && ((t > 10)); then
  timeout "$t" ncu --clock-control none --set full -k "regex:q6k_|sum_parts" \
    -o "$OUT/ncu_auto" -f python3 bench/tile_probe.py --profile --no-torch \
    --shapes 18944x3584,3584x3584 --ns 16,64 --profile-cfgs "" >"$OUT/ncu_auto_run.log" 2>&1
  note "# ncu auto rc=$? (bound ${t} s) $(elapsed)"
  ncu --import "$OUT/ncu_auto.ncu-rep" --page details >"$OUT/ncu_auto_details.txt" 2>&1
  ncu --import "$OUT/ncu_auto.ncu-rep" --page raw --csv --metrics "$M" >"$OUT/ncu_auto.csv" 2>&1
fi
t=$(bound 12 1)
if command -v ncu >/dev/null && ((t > 6)); then
  timeout "$t" ncu --clock-control none --set full -o "$OUT/ncu_torch" -f python3 -c '
import torch
f = torch.nn.functional.linear
for rows, k, n in ((3584, 3584, 64), (18944, 3584, 64)):
    w = torch.ones(rows, k, dtype=torch.float16).cuda()  # host copies: no kernels but the linear
    x = torch.ones(n, k, dtype=torch.float16).cuda()
    f(x, w)
    torch.cuda.synchronize()
' >"$OUT/ncu_torch_run.log" 2>&1
  note "# ncu torch rc=$? (bound ${t} s) $(elapsed)"
  ncu --import "$OUT/ncu_torch.ncu-rep" --page details >"$OUT/ncu_torch_details.txt" 2>&1
  ncu --import "$OUT/ncu_torch.ncu-rep" --page raw --csv --metrics "$M" >"$OUT/ncu_torch.csv" 2>&1
fi
rm -f "$OUT"/*.ncu-rep
echo "== k bundle A (tree $(cat COMMIT 2>/dev/null || echo '?'))"
echo "pytest: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/pytest.log" 2>/dev/null | tail -1)"
grep -E '^(FAILED|ERROR) ' "$OUT/pytest.log" 2>/dev/null | head -4 | cut -c1-200
grep -E "^# compiled|Error" "$OUT/cfg_ab_ksc.log" 2>/dev/null | head -3 | cut -c1-200
echo "# cfg-ab ksc: shape N AUTO us cand us AUTO/cand rel torch (FAILED: K not cut into the cluster size)"
grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/cfg_ab_ksc.log" 2>/dev/null | grep -v FAILED | awk '{print $1, $2, $3, $4, $5, $6, $7, $8, $9}'
echo "# failed candidates: $(grep -c FAILED "$OUT/cfg_ab_ksc.log" 2>/dev/null)"
grep -E "^# profile" "$OUT/ncu_auto_run.log" 2>/dev/null | cut -c1-160
for f in ncu_auto ncu_torch; do
  echo "# $f: kernel, us, DRAM %, SM active/elapsed, achieved occ %, regs, grid, smem-pipe %, issue %, tensor %, stalls/issue long-sb wait short-sb mio math not-sel"
  python3 - "$OUT/$f.csv" <<'EOF' 2>/dev/null
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
if len(rows) > 2:
    h = rows[0]
    def g(r, m):
        try:
            return float(r[h.index(m)].replace(",", ""))
        except (ValueError, IndexError):
            return float("nan")
    for r in rows[2:]:
        name = r[h.index("Kernel Name")][:48]
        us = g(r, "gpu__time_duration.sum") / 1e3
        act = g(r, "sm__cycles_active.avg") / g(r, "gpc__cycles_elapsed.max")
        st = ["long_scoreboard", "wait", "short_scoreboard", "mio_throttle", "math_pipe_throttle", "not_selected"]
        sv = " ".join(f"{g(r, f'smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio'):.2f}" for s in st)
        print(f"{name} {us:.1f} {g(r, 'dram__throughput.avg.pct_of_peak_sustained_elapsed'):.1f} "
              f"{act:.2f} {g(r, 'sm__warps_active.avg.pct_of_peak_sustained_active'):.1f} "
              f"{g(r, 'launch__registers_per_thread'):.0f} {g(r, 'launch__grid_size'):.0f}x{g(r, 'launch__block_size'):.0f} "
              f"{g(r, 'l1tex__throughput.avg.pct_of_peak_sustained_active'):.1f} "
              f"{g(r, 'smsp__issue_active.avg.pct_of_peak_sustained_active'):.1f} "
              f"{g(r, 'sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active'):.1f} {sv}")
EOF
done
(cd "$OUT" && tar czf "$FINAL/k_s15_logs.tgz" -- *)
note "# done $(elapsed)"
