#!/usr/bin/env bash
# k's device command, session 30 (issue 16), bounded by BOUND (s); PHASE picks the bundle's
# part. Session 29's script (PHASE a-d: the stream-K tile sk0-sk2, its probes, the drained
# form) is in git history (bench/gpu_k_s29.sh at commit 0135cd5); its figures: docs/KERNELS.md
# "Session 29". Session 30 had no GPU: what it built was checked on the CPU only (nvcc,
# SASS: docs/KERNELS.md "Session 30"); this script is its device half.
# PHASE=a (bound 100): stream-K v2 (sk3, bench/ab/q6k_wgmma_sk.cu `q6k_wgsk3_f16`,
# bench-only): sk2's units, partition, ring and fix-up order with nothing divergent between a
# segment's units, so ptxas keeps two wgmma groups in flight across units (SASS: 16
# WARPGROUP.DEPBAR.LE gsb0 0x2 a unit and one 0x0 a segment, no C7518; sk2 drains every unit),
# and a parallel fix-up (all flags awaited at once, partials loaded 2-4 at a time). Question:
# does the schedule win once its wgmmas overlap (session 29: sk2 0.83-0.88 of AUTO at N=64 on
# the tall weights, its no-wgmma floor 23.9 us under AUTO's 42.1)?
# 1. smoke: 18944x3584 N=64, sk2 and sk3, one round (sk3 = sk2 bits: xb=same).
# 2. ab: 18944x3584, 14336x4096 and 3584x18944 at N = 16, 32, 64: sk2, sk3 and sk3 on two
#    warpgroups (w2) against AUTO, 3 rounds of 30 calls, torch f16 beside; y against AUTO's
#    and the float64 reference (F16 contract 2e-3), det, sk3 = sk2 bits.
# 3. ref: odd shapes and token counts against the reference (N = 5, 12, 17, 33, 64, 100).
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/k
BOUND=${BOUND:-100}
note "# setup done $(elapsed)"

sk_report() {
  echo "# $1: shape N variant us AUTO-us AUTO/it torch rel(AUTO) relfro(ref) det xb"
  grep -E "^# NVIDIA|^ *[0-9]+x[0-9]+ +[0-9]+ |Error|error" "$OUT/$1.log" 2>/dev/null \
    | sed -E 's/ +/ /g' | cut -c1-150
}

if [[ ${PHASE:-a} == a ]]; then
  step smoke 20 python3 bench/sk_ab.py --cells 18944x3584:64 --variants sk2,sk3 --rounds 1 \
    --iters 5 --no-torch --json "$OUT/smoke.json"
  C="18944x3584:64,14336x4096:64,3584x18944:64,18944x3584:32,14336x4096:32,3584x18944:32"
  C+=",18944x3584:16,14336x4096:16,3584x18944:16"
  step ab 52 python3 bench/sk_ab.py --cells "$C" --variants sk2,sk3,sk3.w2 --rounds 3 \
    --iters 30 --json "$OUT/ab.json"
  C="300x2304:64,33x9472:64,1000x512:33,64x1024:5,4096x4096:64,3584x3584:17,4096x4096:100"
  C+=",3584x3584:12"
  left 6 && step ref 14 python3 bench/sk_ab.py --cells "$C" --variants sk2,sk3 --rounds 1 \
    --iters 3 --no-torch --ref-rows 4096 --json "$OUT/ref.json"
  { echo "== k session 30 PHASE=a (tree $(tree_commit)), $(elapsed)"; steps; sk_report smoke
    sk_report ab; sk_report ref; } | table
  exit 0
fi
# PHASE=b (bound 100): the product side of session 30 on the GPU. Its kernel-source refactor
# (helpers folded in) compiled to the same SASS as main for every kernel and its removal of the
# variants no dispatch choice reaches (the K-slice tile without the register prefetch, 2
# m-tiles a warp) left every reachable kernel's SASS unchanged (bench/ab/sass_same.py), so no
# result or time can have moved; this confirms it where it counts.
# gputests: the GPU tests of the tiles touched (the K-slice and cluster-sum tiles, the wgmma
# tile, the backend's accuracy contract on every path and layout, pair streams, the top-k
# epilogue; all of tests/kernels took 97 s in session 29's closing check).
# PHASE=c (bound 60): Nsight Compute (metrics only) of AUTO, sk2 and sk3 on 18944x3584 N=64:
# issue %, tensor-pipe %, stalls (session 29's sk2: issue 30%, hmma 22.8%, long scoreboard 3.4,
# barrier 2.1 per issue; AUTO's tile 45.6% / 33.4%): are sk3's wgmmas in flight on the device.
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
M+=,dram__bytes_read.sum.per_second,dram__bytes_write.sum,sm__cycles_active.avg
M+=,gpc__cycles_elapsed.max,sm__warps_active.avg.per_cycle_active,launch__registers_per_thread
M+=,launch__grid_size,launch__block_size,smsp__issue_active.avg.pct_of_peak_sustained_active
M+=,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed
M+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct
for r in long_scoreboard short_scoreboard mio_throttle math_pipe_throttle barrier wait \
    not_selected lg_throttle; do M+=",smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
ncu_report() {  # the CSV export, one line per kernel
  echo "# ncu: kernel grid block regs us DRAM% rdTB/s wrMB SMactive% warps/SM issue% smem% hmma% L2hit% | stalls lsb ssb mio math bar wait nsel lg"
  python3 - "$OUT" <<'PY'
import csv, os, sys
p = os.path.join(sys.argv[1], "ncu_sk.csv")
rows = [r for r in csv.reader(open(p))] if os.path.exists(p) else []
rows = [r for r in rows if len(r) > 5]
if len(rows) < 3:
    print("ncu_sk unreadable or absent")
    sys.exit(0)
h = rows[0]
g = lambda row, m: row[h.index(m)] if m in h else "?"
num = lambda s: float(s.replace(",", ""))
st = "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio"
for row in rows[2:]:
    try:
        act = 100 * num(g(row, "sm__cycles_active.avg")) / num(g(row, "gpc__cycles_elapsed.max"))
    except ValueError:
        act = float("nan")
    name = g(row, "Kernel Name").split("(")[0].replace(" ", "")[:40]
    vals = [g(row, m) for m in ("launch__grid_size", "launch__block_size",
            "launch__registers_per_thread", "gpu__time_duration.sum",
            "dram__throughput.avg.pct_of_peak_sustained_elapsed",
            "dram__bytes_read.sum.per_second", "dram__bytes_write.sum")]
    vals += [f"{act:.0f}"] + [g(row, m) for m in (
        "sm__warps_active.avg.per_cycle_active", "smsp__issue_active.avg.pct_of_peak_sustained_active",
        "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed",
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
        "lts__t_sector_hit_rate.pct")]
    vals += ["|"] + [g(row, st % s) for s in ("long_scoreboard", "short_scoreboard",
             "mio_throttle", "math_pipe_throttle", "barrier", "wait", "not_selected", "lg_throttle")]
    print(name, " ".join(vals))
PY
}
export OUT
if [[ ${PHASE} == b ]]; then
  step gputests 90 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/kernels/test_cuda_ks.py tests/kernels/test_cuda_ksc.py tests/kernels/test_cuda_wg.py \
    tests/kernels/test_cuda_backend.py tests/kernels/test_cuda_pairs.py \
    tests/kernels/test_epilogue.py
  { echo "== k session 30 PHASE=b (tree $(tree_commit)), $(elapsed)"; steps
    tail -n 3 "$OUT/gputests.log" 2>/dev/null; } | table
  exit 0
fi
if [[ ${PHASE} == c ]]; then
  if command -v ncu >/dev/null; then
    left 8 && step ncu 40 ncu --clock-control none --metrics "$M" \
      -k "regex:q6k_(wg|wgsk|wgsk3)_f16|q6k_sum_parts|q6k_sk_xb" --launch-count 6 \
      -o "$OUT/ncu_sk" -f python3 bench/sk_ab.py --cells 18944x3584:64 --variants sk2,sk3 \
      --rounds 1 --iters 2 --recheck 0 --no-torch --ref-rows 64
    [[ -f $OUT/ncu_sk.ncu-rep ]] && ncu --import "$OUT/ncu_sk.ncu-rep" --page raw --csv \
      >"$OUT/ncu_sk.csv" 2>&1
  fi
  { echo "== k session 30 PHASE=c (tree $(tree_commit)), $(elapsed)"; steps; ncu_report; } \
    | table
  exit 0
fi
echo "PHASE=${PHASE} not written yet"
exit 2
