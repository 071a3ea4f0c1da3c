#!/usr/bin/env bash
# k's bundle-B command (session 15), bounded by CALL_S (100 s):
#   1. Nsight Compute (--set full) of torch's f16 linear (cuBLAS) on 3584x3584 at N = 16, 64
#      and 18944x3584 N=64 (weights copied from the host: the linear's are the only kernels):
#      what the kernels are compared with in the missed "faster than torch" cells;
#   2. Nsight Compute of AUTO and the cluster-sum tile (src 7) at AUTO's launch shape on
#      4096x14336 N=16 and 14336x4096 N=16 (the experiment's cells), with the split-K sum;
#   3. a second --cfg-ab of the experiment (another process: bundle A's was the first).
# Run: `bash bench/gpu_k_s15b.sh` from the tree's root (gpu_session installs the wheels).
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks15b
CALL_S=${CALL_S:-100}
left() { echo $((CALL_S - $(date +%s) + T0)); }
bound() { local l; l=$(($(left) - ${2:-0})); ((l < $1)) && echo "$l" || echo "$1"; }
note "# setup done $(elapsed)"
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg,gpc__cycles_elapsed.max,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__throughput.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio
t=$(bound 25 60)
if command -v ncu >/dev/null && ((t > 8)); then
  timeout "$t" ncu --clock-control none --set full -o "$OUT/ncu_torch" -f python3 -c '
import torch
f = torch.nn.functional.linear
for rows, k, n in ((3584, 3584, 16), (3584, 3584, 64), (18944, 3584, 64)):
    w = torch.ones(rows, k, dtype=torch.float16).cuda()  # host copies: no kernels but the linear
    x = torch.ones(n, k, dtype=torch.float16).cuda()
    f(x, w)
    torch.cuda.synchronize()
' >"$OUT/ncu_torch_run.log" 2>&1
  note "# ncu torch rc=$? (bound ${t} s) $(elapsed)"
  ncu --import "$OUT/ncu_torch.ncu-rep" --page details >"$OUT/ncu_torch_details.txt" 2>&1
  ncu --import "$OUT/ncu_torch.ncu-rep" --page raw --csv --metrics "$M" >"$OUT/ncu_torch.csv" 2>&1
fi
KSC16=${KSC16:-"16:nt=2,warps=16,src=7,pf=1,ksplit=8"}
t=$(bound 30 30)
if command -v ncu >/dev/null && ((t > 10)); then
  timeout "$t" ncu --clock-control none --set full -k "regex:q6k_|sum_parts" \
    -o "$OUT/ncu_ksc" -f python3 bench/tile_probe.py --profile --no-torch \
    --shapes "${KSC_SHAPES:-4096x14336}" --ns 16 --profile-cfgs "$KSC16" >"$OUT/ncu_ksc_run.log" 2>&1
  note "# ncu ksc rc=$? (bound ${t} s) $(elapsed)"
  ncu --import "$OUT/ncu_ksc.ncu-rep" --page details >"$OUT/ncu_ksc_details.txt" 2>&1
  ncu --import "$OUT/ncu_ksc.ncu-rep" --page raw --csv --metrics "$M" >"$OUT/ncu_ksc.csv" 2>&1
fi
t=$(bound 30 2)
if [[ -n ${CFGAB:-} ]] && ((t > 10)); then
  timeout "$t" python3 bench/kernels.py --cfg-ab "$CFGAB" --rounds 3 --iters 20 \
    --shapes "${CFGAB_SHAPES:-4096x14336,14336x4096,18944x3584,3584x18944,3584x3584}" \
    --json "$OUT/cfg_ab_ksc2.json" >"$OUT/cfg_ab_ksc2.log" 2>&1
  note "# cfg-ab ksc2 rc=$? (bound ${t} s) $(elapsed)"
fi
rm -f "$OUT"/*.ncu-rep
echo "== k bundle B (tree $(cat COMMIT 2>/dev/null || echo '?'))"
echo "# cfg-ab ksc (2nd): shape N AUTO us cand us AUTO/cand rel torch"
grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ " "$OUT/cfg_ab_ksc2.log" 2>/dev/null | grep -v FAILED | awk '{print $1, $2, $3, $4, $5, $6, $7, $8, $9}'
grep -E "^# profile" "$OUT/ncu_ksc_run.log" 2>/dev/null | cut -c1-160
for f in ncu_torch ncu_ksc; do
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
(cd "$OUT" && tar czf "$FINAL/k_s15b_logs.tgz" -- *)
note "# done $(elapsed)"
