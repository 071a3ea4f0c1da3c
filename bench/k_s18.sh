#!/usr/bin/env bash
# k's device command, session 18 (issue 16), bounded by BOUND (s). Bundle A:
#   1. tableab: the table to land against main's (bench/results/2026-12-03_dispatch_h200_482b631.json):
#      each changed cell old / new alternated in one process (session 17's cells on today's main;
#      the src 2 pf cells are the first-block-early A/B in one process);
#   2. sweep_lo / sweep_hi: the N <= 8 rule for weights outside the table (dispatch.KSLICE_WEIGHT):
#      per shape and N = 1, 2, 4, 8, AUTO (this tree's dispatch) against the f16 tile src 2 (what
#      the heuristic ran before the rule) and the K-slice tile at 8 and 16 warps, alternated, bits
#      compared; shapes around the threshold (45-117 M elements) and 14B/32B/70B/72B shapes above;
#   3. pytest: the GPU tests of the changed paths (src 2 with pf bit-identical to without, every
#      table launch shape on pair/SoA weights against the reference, src 7);
#   4. ncu / ncu_torch: Nsight Compute, metrics only, of AUTO's kernels on the missed cells
#      (4096x14336, 18944x3584, 3584x3584 at N = 8..64) and of torch's f16 linear at N = 64 on
#      4096x14336 and 3584x3584, imported to CSV (ncu_*.csv) and summarized.
# PHASE=b (bundle B): goal 3, N = 32/64 below the lm-heads (0.68-0.99x of torch in session 17's
# closing check): --cfg-ab of launch shapes the tune never timed (K splits of the K-slice, wgmma
# and cluster-sum tiles) against AUTO on the six 11-56 MB shapes, then the steps PHASE_B_MORE
# names (a subset of bundle A's: "tableab sweep pytest ncu"). PHASE=c: bundle C (below).
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks18${PHASE:-}
BOUND=${BOUND:-196}
note "# setup done $(elapsed)"
want() { [[ ${PHASE:-a} == a || " ${PHASE_B_MORE:-} " == *" $1 "* ]]; }  # (PHASE c: its own)
if [[ ${PHASE:-a} == b ]]; then
  C64="" C32=""
  for k in 0 2 3 4; do C64+="64:nt=8,src=6,pf=1,warps=12,ksplit=$k;"; done
  for k in 0 2 3; do C64+="64:nt=8,src=6,pf=1,ksplit=$k;"; done
  for k in 2 3 4; do C64+="64:nt=8,src=4,pf=1,ksplit=$k;64:nt=8,src=7,pf=1,ksplit=$k;"; done
  C64+="64:nt=8,src=4,warps=12;"
  for k in 2 3 4; do C32+="32:nt=4,src=4,pf=1,ksplit=$k;32:nt=4,src=7,pf=1,ksplit=$k;"; done
  C32+="32:nt=4,src=4,pf=1,warps=12;32:nt=4,src=4,pf=1,warps=16;32:nt=4,src=5,warps=16;"
  C32+="32:nt=8,src=6,pf=1,warps=12;"
  # the N <= 8 rule at its threshold (1e8) and below: AUTO against src 2, the K-slice tile, and
  # the cluster-sum / src 2 tiles at K split 2 (11008x4096 takes 14336x4096's cells, whose K split
  # the nearest-shape lookup drops)
  R=""
  for n in 1 2 4 8; do R+="$n:nt=1;$n:nt=1,src=4,pf=1;$n:nt=1,src=7,pf=1,ksplit=2;$n:nt=1,ksplit=2;"; done
  step rule 40 python3 bench/kernels.py --cfg-ab "$R" --rounds 2 --iters 30 --no-torch \
    --shapes 10240x10240,8192x11264,8192x14336,11008x4096,27648x5120 --json "$OUT/rule.json"
  step n64 60 python3 bench/kernels.py --cfg-ab "$C64$C32" --rounds 2 --iters 40 \
    --shapes 3584x3584,4096x4096,14336x4096,4096x14336,18944x3584,3584x18944 --json "$OUT/n64.json"
fi
if [[ ${PHASE:-a} == c ]]; then
  # bundle C: the two N = 32 cells bundle B's --cfg-ab found (14336x4096 nt4.w8 at K split 4 1.031,
  # 3584x3584 src 7 at K split 4 1.023) against the table landed before them, the GPU tests of
  # the table's launch shapes, and the K-slice grid model's K split at N = 1 (27648x5120: 20
  # one-block slices, 46.3 us, where N = 4's one slice took 39.6; 8192x11264: 44 slices 34.1 us,
  # N = 2's 4 slices 27.1): forced splits against AUTO
  step tableab 20 python3 bench/kernels.py --table-ab bench/results/2026-12-03_dispatch_h200_ce8a3fe.json \
    --columns auto --iters 40 --shapes 14336x4096,3584x3584 --ns 32 --json "$OUT/tableab.json"
  step pytest 25 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=60 \
    tests/kernels/test_cuda_pairs.py tests/kernels/test_cuda_ksc.py -k "every_table_shape or ksc or cluster"
  G=""
  for k in 1 2 4 7 10 20; do G+="1:nt=1,src=4,pf=1,ksplit=$k;"; done
  step grid 20 python3 bench/kernels.py --cfg-ab "$G" --rounds 2 --iters 30 --no-torch \
    --shapes 27648x5120,8192x11264,10240x10240 --json "$OUT/grid.json"
fi
want tableab && step tableab 25 python3 bench/kernels.py --table-ab bench/results/2026-12-03_dispatch_h200_482b631.json \
  --columns auto --iters 40 --shapes 14336x4096,18944x3584 --ns 1,2 \
  --json "$OUT/tableab.json"
C=""
for n in 1 2 4 8; do C+="$n:nt=1;$n:nt=1,src=4,pf=1;$n:nt=1,src=4,pf=1,warps=16;"; done
want sweep && step sweep_lo 40 python3 bench/kernels.py --cfg-ab "$C" --rounds 2 --iters 30 --no-torch \
  --shapes 8192x14336,13824x5120,5120x13824,8192x8192,11008x4096 --json "$OUT/sweep_lo.json"
want sweep && step sweep_hi 45 python3 bench/kernels.py --cfg-ab "$C" --rounds 2 --iters 30 --no-torch \
  --shapes 32768x4096,27648x5120,5120x27648,16384x14336,28672x8192,8192x28672,29568x8192 \
  --json "$OUT/sweep_hi.json"
want pytest && step pytest 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=60 \
  tests/kernels/test_cuda_src2_pf.py tests/kernels/test_cuda_pairs.py tests/kernels/test_cuda_ksc.py \
  tests/kernels/test_cuda_backend.py -k "src2 or first_block or every_table_shape or auto_through \
or accuracy or odd_shapes or half_act or soa_and_aos or every_launch_variant or deterministic \
or n_sweep or graphs_and or ksc or cluster"
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
M+=,dram__bytes_read.sum.per_second,sm__cycles_active.avg,gpc__cycles_elapsed.max
M+=,sm__warps_active.avg.per_cycle_active,launch__registers_per_thread,launch__grid_size
M+=,launch__block_size,smsp__issue_active.avg.pct_of_peak_sustained_active
M+=,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed
M+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
for r in long_scoreboard short_scoreboard mio_throttle math_pipe_throttle barrier wait \
    not_selected lg_throttle; do M+=",smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
# (the metrics gpu_run.sh's kstall/stalls modes ran: the fallback if a newer name is refused)
M_SAFE=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
M_SAFE+=,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
M_SAFE+=,smsp__issue_active.avg.pct_of_peak_sustained_active
M_SAFE+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
for r in long_scoreboard short_scoreboard mio_throttle math_pipe_throttle barrier wait \
    not_selected lg_throttle; do M_SAFE+=",smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
ncu_auto() {
  ncu --clock-control none --metrics "$1" -k "regex:q6k_(ks|ksc|ksr|mma|wg)_f16|q6k_sum_parts" \
    -o "$OUT/ncu_auto" -f python3 bench/tile_probe.py --profile --no-torch --profile-cfgs "" \
    --shapes 4096x14336,18944x3584,3584x3584 --ns 1,8,16,32,64
}
ncu_torch() {
  ncu --clock-control none --metrics "$1" -k "regex:nvjet|gemm|gemv|cutlass|xmma" \
    -o "$OUT/ncu_torch" -f python3 -c "
import torch
for r, k, n in ((4096, 14336, 16), (4096, 14336, 64), (3584, 3584, 64), (18944, 3584, 64)):
    ws = [torch.randn(r, k, device='cuda', dtype=torch.float16) * 0.02 for _ in range(2)]
    x = torch.randn(n, k, device='cuda', dtype=torch.float16)
    for w in ws:
        torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
    print('# torch', r, k, 'N', n, flush=True)
"
}
export OUT
export -f ncu_auto ncu_torch  # (step's `timeout` runs a command: the functions through bash -c)
if want ncu && command -v ncu >/dev/null; then
  step ncu 40 bash -c 'ncu_auto "$1"' _ "$M" || step ncu_safe 40 bash -c 'ncu_auto "$1"' _ "$M_SAFE"
  step ncu_torch 25 bash -c 'ncu_torch "$1"' _ "$M" ||
    step ncu_torch_safe 25 bash -c 'ncu_torch "$1"' _ "$M_SAFE"
  for f in ncu_auto ncu_torch; do
    [[ -f $OUT/$f.ncu-rep ]] && ncu --import "$OUT/$f.ncu-rep" --page raw --csv >"$OUT/$f.csv" 2>&1
  done
elif want ncu; then
  note "# no ncu on this machine"
fi
{
  echo "== k bundle ${PHASE:-a} (tree $(tree_commit)), $(elapsed)"
  steps
  echo "# N=32/64 launch shapes vs AUTO (one process, alternated): shape N AUTO us torch | best 3 candidates us AUTO/cand rel"
  python3 - "$OUT" <<'EOF'
import os, re, sys
p = os.path.join(sys.argv[1], "n64.log")
t = {}
for line in open(p) if os.path.exists(p) else []:
    m = re.match(r"\s*(\d+x\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)\s+(\S+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)\s+(\S+)", line)
    if m:
        d = t.setdefault((m[1], int(m[2])), {"auto": (m[3], m[4], m[9]), "c": []})
        d["c"].append((float(m[6]), m[5], m[7], m[8]))
for (shape, n), d in t.items():
    best = sorted(d["c"])[:3]
    print(shape, n, d["auto"][0], d["auto"][1], "torch", d["auto"][2], "|",
          "  ".join(f"{lab} {us:.1f} {x} {rel}" for us, lab, x, rel in best))
EOF
  echo "# table A/B (one process, old/new alternated): shape N column old pick us new pick us TB/s old/new"
  grep -E "^ *[0-9]+x[0-9]+ +[0-9]+ +(auto|f16)" "$OUT/tableab.log" | awk '{print $1, $2, $3, $4, $5, $6, $7, $8, $9}'
  echo "# N<=8 rule sweep: shape N AUTO us | src2 (nt1.m1.w8.s2) us, ks8 (nt1.m1.w8.s4.pf) us, ks16 us | src2/best-ks | others"
  python3 - "$OUT" <<'EOF'
import glob, os, re, sys
# --cfg-ab's lines (the log, so a step cut by its bound still counts): shape N AUTO us cand us ...
t = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "sweep_*.log"))) + sorted(
        glob.glob(os.path.join(sys.argv[1], "rule.log"))) + sorted(
        glob.glob(os.path.join(sys.argv[1], "grid.log"))):
    for line in open(f):
        m = re.match(r"\s*(\d+x\d+)\s+(\d+)\s+(\S+)\s+([\d.]+)\s+(\S+)\s+([\d.]+)\s", line)
        if m:
            d = t.setdefault((m[1], int(m[2])), {"auto": (m[3], float(m[4]))})
            d[m[5]] = float(m[6])
fmt = lambda v: f"{v:.1f}" if v else "-"
for (shape, n), d in t.items():
    s2, k8, k16 = (d.get(x) for x in ("nt1.m1.w8.s2", "nt1.m1.w8.s4.pf", "nt1.m1.w16.s4.pf"))
    ks = min(v for v in (k8, k16) if v) if (k8 or k16) else None
    rest = " ".join(f"{lab} {us:.1f}" for lab, us in d.items() if lab not in (
        "auto", "nt1.m1.w8.s2", "nt1.m1.w8.s4.pf", "nt1.m1.w16.s4.pf"))
    print(shape, n, d["auto"][0], fmt(d["auto"][1]), "|", fmt(s2), fmt(k8), fmt(k16), "|",
          f"{s2 / ks:.3f}" if s2 and ks else "-", "|", rest)
EOF
  echo "# ncu (metrics only): kernel grid block regs us DRAM% TB/s SMactive% warps/SM issue% smem% hmma% | stalls lsb ssb mio math bar wait nsel lg"
  python3 - "$OUT" <<'EOF'
import csv, os, sys
for f in ("ncu_auto.csv", "ncu_torch.csv"):
    p = os.path.join(sys.argv[1], f)
    if not os.path.exists(p):
        continue
    rows = [r for r in csv.reader(open(p)) if len(r) > 5]
    if len(rows) < 3:
        print(f, "unreadable:", open(p).read()[:200].replace("\n", " "))
        continue
    h = rows[0]
    g = lambda row, m: row[h.index(m)] if m in h else "?"
    st = "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio"
    for row in rows[2:]:
        try:
            act = 100 * float(g(row, "sm__cycles_active.avg").replace(",", "")) / float(
                g(row, "gpc__cycles_elapsed.max").replace(",", ""))
        except ValueError:
            act = float("nan")
        name = g(row, "Kernel Name").split("(")[0].replace(" ", "")[:40]
        vals = [g(row, m) for m in ("launch__grid_size", "launch__block_size",
                "launch__registers_per_thread", "gpu__time_duration.sum",
                "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                "dram__bytes_read.sum.per_second")]
        vals += [f"{act:.0f}"] + [g(row, m) for m in (
            "sm__warps_active.avg.per_cycle_active", "smsp__issue_active.avg.pct_of_peak_sustained_active",
            "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed",
            "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active")]
        vals += ["|"] + [g(row, st % s) for s in ("long_scoreboard", "short_scoreboard",
                 "mio_throttle", "math_pipe_throttle", "barrier", "wait", "not_selected", "lg_throttle")]
        print(f[:-4], name, " ".join(vals))
EOF
} | table
