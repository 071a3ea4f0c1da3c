#!/usr/bin/env bash
# k's device command, session 29 (issue 16: the tall weights at N = 32..64 by a stream-K
# schedule; then N=16 on the 48-56 MB weights), bounded by BOUND (s); PHASE picks the bundle's
# part. Session 28's script (PHASE a-d: ncu at N=64, evict-first weights, a tile queue, the
# bulk-copy staging, K-split sweeps, half-block slices, row chunks of whole rounds) is in git
# history (bench/gpu_k_s28.sh at commit 18ed38c); its figures: docs/KERNELS.md "Session 28".
# PHASE=a (bound 100): bench/sk_ab.py, the stream-K wgmma tile of bench/ab/q6k_wgmma_sk.cu
# (bench-only; the product's kernels untouched): one CTA per SM, each a contiguous run of
# (3-tile row group, K block) units, an activation ring of 4 stages (one K block each) two
# units ahead, the row groups split between CTAs summed by their owner in a fixed order
# (deterministic). sk0 stages each unit's activations from x (4-byte copies), sk1 from a
# prepacked copy in the B layout (a prepass launch first, 16-byte copies). Against AUTO's
# launch of the same cell, alternated in one process, torch f16 beside; y against AUTO's and
# the float64 NumPy reference (F16 contract 2e-3), the same bits on a repeat and on a fresh x.
# 1. smoke: 18944x3584 N=64, one round (a hung fix-up gives up after ~1 s and is counted).
# 2. ab: the tall weights (18944x3584, 14336x4096) at N = 64, 32, 48 and the wide ones
#    (4096x14336, 3584x18944) at 64: 3 rounds of 30 calls.
# 3. ref: odd shapes and token counts (rows that fill no row group, 1-37 units, K of 2-37
#    blocks, N = 17, 33, 100 (two token chunks)) against the reference, one round.
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
  step smoke 24 python3 bench/sk_ab.py --cells 18944x3584:64 --variants sk0,sk1 --rounds 1 \
    --iters 5 --no-torch --json "$OUT/smoke.json"
  C="18944x3584:64,14336x4096:64,18944x3584:32,14336x4096:32,18944x3584:48,4096x14336:64"
  C+=",3584x18944:64,14336x4096:48"
  step ab 46 python3 bench/sk_ab.py --cells "$C" --variants sk0,sk1 --rounds 3 --iters 30 \
    --json "$OUT/ab.json"
  C="300x2304:64,33x9472:64,1000x512:33,64x1024:64,4096x4096:64,3584x3584:17,4096x4096:100"
  left 6 && step ref 16 python3 bench/sk_ab.py --cells "$C" --variants sk0,sk1 --rounds 1 \
    --iters 3 --no-torch --ref-rows 4096 --json "$OUT/ref.json"
  { echo "== k session 29 PHASE=a (tree $(tree_commit)), $(elapsed)"; steps; sk_report smoke
    sk_report ab; sk_report ref; } | table
  exit 0
fi
# PHASE=b (bound 100). Bundle A (tree 2531959, 30 s): sk0 / sk1 wrong on every shape whose
# CTAs cross a row group (18944x3584, 14336x4096, 3584x18944: NaN or rel 0.13-0.32, not
# deterministic; 4096x14336, whose 132 runs each lie inside one row group, right: rel 3.4e-4,
# det, the same bits in sk0 and sk1) and slow: AUTO / sk 0.60-0.83 (18944x3584 N=64 sk1 50.9
# against AUTO 42.2 us: ~4.7 us a unit against the model's 2.6). The bug: a warpgroup with no
# tile in its first row group (the last row group of 2 tiles of 3) never loaded its first
# weights of the next one (fixed). This tree adds sk2: the prepacked activation block by one
# bulk copy a unit on an mbarrier ring (6 stages), no barrier of the CTA a unit (a warpgroup
# waits for its unit's bytes, thread 0 for a stage's readers of 6 units before).
# 1. smoke: 18944x3584 N=64, sk1 and sk2, one round.
# 2. ab: N=64 / 32 on the tall weights, N=16 on the four 48-56 MB shapes (ask 2: the m64n16k16
#    form), 3584x18944 N=64; sk1 and sk2 against AUTO, 3 rounds of 30 calls, torch beside.
# 3. ref: odd shapes and token counts against the float64 reference (N = 5, 12, 17, 33, 64,
#    100), one round.
# 4. ncu: Nsight Compute (metrics only) of AUTO, sk1 and sk2 on 18944x3584 N=64: where a
#    unit's ~4.7 us go (issue, stalls: barrier, long scoreboard, wait).
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
M+=,dram__bytes_read.sum.per_second,dram__bytes_write.sum,sm__cycles_active.avg
M+=,gpc__cycles_elapsed.max,sm__warps_active.avg.per_cycle_active,launch__registers_per_thread
M+=,launch__grid_size,launch__block_size,smsp__issue_active.avg.pct_of_peak_sustained_active
M+=,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed
M+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct
for r in long_scoreboard short_scoreboard mio_throttle math_pipe_throttle barrier wait \
    not_selected lg_throttle; do M+=",smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
ncu_report() {  # the CSV exports, one line per kernel
  echo "# ncu: kernel grid block regs us DRAM% rdTB/s wrMB SMactive% warps/SM issue% smem% hmma% L2hit% | stalls lsb ssb mio math bar wait nsel lg"
  python3 - "$OUT" <<'PY'
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
        print(f[:-4], name, " ".join(vals))
PY
}
export OUT
if [[ ${PHASE} == b ]]; then
  step smoke 20 python3 bench/sk_ab.py --cells 18944x3584:64 --variants sk1,sk2 --rounds 1 \
    --iters 5 --no-torch --json "$OUT/smoke.json"
  C="18944x3584:64,14336x4096:64,18944x3584:16,4096x14336:16,14336x4096:16,3584x18944:16"
  C+=",18944x3584:32,14336x4096:32,3584x18944:64"
  step ab 40 python3 bench/sk_ab.py --cells "$C" --variants sk1,sk2 --rounds 3 --iters 30 \
    --json "$OUT/ab.json"
  C="300x2304:64,33x9472:64,1000x512:33,64x1024:5,4096x4096:64,3584x3584:17,4096x4096:100"
  C+=",3584x3584:12"
  left 6 && step ref 14 python3 bench/sk_ab.py --cells "$C" --variants sk1,sk2 --rounds 1 \
    --iters 3 --no-torch --ref-rows 4096 --json "$OUT/ref.json"
  if command -v ncu >/dev/null; then
    left 8 && step ncu 20 ncu --clock-control none --metrics "$M" \
      -k "regex:q6k_(wg|wgsk)_f16|q6k_sum_parts|q6k_sk_xb" --launch-count 6 -o "$OUT/ncu_auto" \
      -f python3 bench/sk_ab.py --cells 18944x3584:64 --variants sk1,sk2 --rounds 1 --iters 2 \
      --recheck 0 --no-torch --ref-rows 64
    [[ -f $OUT/ncu_auto.ncu-rep ]] && ncu --import "$OUT/ncu_auto.ncu-rep" --page raw --csv \
      >"$OUT/ncu_auto.csv" 2>&1
  fi
  { echo "== k session 29 PHASE=b (tree $(tree_commit)), $(elapsed)"; steps; sk_report smoke
    sk_report ab; sk_report ref; ncu_report; } | table
  exit 0
fi
# PHASE=c (bound 60; bundle C). Bundle B (tree 8e5454c, 64 s): right everywhere now (rel
# 2.3-3.7e-4 to AUTO, 2.4-3.0e-4 to the reference, det, sk1 = sk2 bits; odd shapes and N = 5,
# 33, 64 too) but slow: sk2 0.79-0.85 of AUTO at N=64 on the tall weights (18944x3584 48.5 vs
# 41.3 us), 0.57-0.71 at N=16, 0.67 on 3584x18944 N=64; sk2 (no barrier a unit) 1.06-1.10x sk1.
# ncu (18944x3584 N=64): sk2's tile 46.1 us, DRAM 26.5%, issue 30% (AUTO's tile 45.6%), long
# scoreboard 3.4 and barrier 2.1 per issue (AUTO 1.1 / 0.07). Where a unit's ~4.3 us go:
# 1. probe: sk2 against its probes (timing only, y wrong): nofix (no fix-up wait), nomma (no
#    wgmma), nodeq (no decode), nomma.nodeq (loads, staging and the loop alone), d3 (dmax from
#    12 blocks in registers: no serial d loads where a segment has > 8 blocks), w2 (two
#    warpgroups a CTA: 2-tile units); 18944x3584 N = 64 and 16, AUTO beside, 2 rounds.
# 2. g66: sk2 on 66 CTAs (two SMs' units each): a unit's time where half the SMs stream.
if [[ ${PHASE} == c ]]; then
  step probe 36 python3 bench/sk_ab.py --cells 18944x3584:64,18944x3584:16 \
    --variants sk2,sk2.d3,sk2.nofix,sk2.nomma,sk2.nodeq,sk2.nomma.nodeq,sk2.w2 --rounds 2 \
    --iters 20 --no-torch --recheck 0 --ref-rows 256 --json "$OUT/probe.json"
  left 8 && step g66 14 python3 bench/sk_ab.py --cells 18944x3584:64 --variants sk2 --grid 66 \
    --rounds 2 --iters 20 --no-torch --recheck 0 --ref-rows 256 --json "$OUT/g66.json"
  { echo "== k session 29 PHASE=c (tree $(tree_commit)), $(elapsed)"; steps; sk_report probe
    sk_report g66; } | table
  exit 0
fi
# PHASE=d (bound 45; an extra bundle if the lead has one). Bundle C (tree 9bb2aa3, 25 s): on
# 18944x3584 N=64 / 16 sk2 49.5 / 37.9 us (AUTO 42.1 / 27.1), nomma 23.9 / 18.8, nodeq 43.7 /
# 33.2, nofix 43.8 / 35.7, d3 48.8 / 37.8, w2 53.0 / 44.3; 66 CTAs 69.1: the wgmmas cost half
# the kernel. Why: ptxas serialized every wgmma of every sk build (C7518, "WG.DP in divergent
# path": a wgmma in flight across the next unit's divergent head), which bundles A-C all ran;
# AUTO's tile has no such warning. This tree drains each unit (Q6SERVE_SK_DRAIN 1: wg_wait<0>
# at its end): no C7518 (test_sk_ab_tools checks), nt 8 at 3 warpgroups spills 16 B (with
# Q6SERVE_SK_LATE_RN 1: the next segment's rows and d loaded at the last unit; 84-108 B without), 2
# warpgroups (w2) 190 registers, none. 1. d: sk2, sk2.w2, sk2.d1, sk1 against AUTO on the tall
# weights at N = 64 / 32 / 16 and 3584x18944 N=64, torch beside; 2. ref: odd shapes (sk2).
# Ran in bundle D (tree 91f082f, 43 s): right everywhere, still lost - sk2 0.83-0.88 of AUTO at
# N=64 on the tall weights, 0.60-0.77 at N = 16/32 (docs/KERNELS.md "Session 29").
if [[ ${PHASE} == d ]]; then
  C="18944x3584:64,14336x4096:64,18944x3584:16,14336x4096:32,3584x18944:64,4096x14336:16"
  step d 30 python3 bench/sk_ab.py --cells "$C" --variants sk2,sk2.w2,sk2.d1,sk1 --rounds 2 \
    --iters 20 --recheck 1 --json "$OUT/d.json"
  left 6 && step ref 10 python3 bench/sk_ab.py --cells 3584x3584:64,300x2304:64,64x1024:5 \
    --variants sk2,sk2.w2 --rounds 1 --iters 3 --no-torch --ref-rows 4096 --json "$OUT/ref.json"
  { echo "== k session 29 PHASE=d (tree $(tree_commit)), $(elapsed)"; steps; sk_report d
    sk_report ref; } | table
  exit 0
fi
echo "PHASE=${PHASE} not written yet"
exit 2
