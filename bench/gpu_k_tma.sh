#!/usr/bin/env bash
# One device call (issue 16, session 9, helper k): the TMA-fed tile q6k_tma_f16 (mma_f16 src 7,
# kernels/cuda/q6k_tma.cu). On one machine: its GPU tests; bench/tile_probe.py --tma-only on
# the 48-56 MB shapes and the Qwen lm-head at N = 16/32/64 (reference rows, SoA/AoS and repeat
# bit-identity, CUDA-event medians over rotated copies past L2, beside AUTO and torch's f16
# linear); Nsight Compute metrics of the TMA launches (and AUTO's K-slice/wgmma kernel) on
# 4096x14336 at N = 16 and 64. A short table last; logs archived into the returned folder.
#   bench/gpu_k_tma.sh   (env: SHAPES, NS, NCU_NS, TEST_TIMEOUT, PROBE_TIMEOUT, NCU_TIMEOUT)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/k_tma
note "# setup $(elapsed)"
SHAPES=${SHAPES:-4096x14336,14336x4096,18944x3584,3584x18944,152064x3584}
NS=${NS:-16,32,64}

timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -m gpu -q -rfE --maxfail=5 -p no:cacheprovider \
  tests/kernels/test_cuda_tma.py >"$OUT/pytest_tma.log" 2>&1
test_rc=$?
tail -4 "$OUT/pytest_tma.log"
note "# tmatest rc=$test_rc $(elapsed)"
if [[ $test_rc == 124 || $test_rc == 137 ]]; then  # a hung ring (mbarrier phases): stop here
  tar czf "$FINAL/k_tma_logs.tgz" -C "$OUT" . 2>/dev/null
  cp "$OUT/pytest_tma.log" "$FINAL/" 2>/dev/null
  exit 1
fi

timeout "${PROBE_TIMEOUT:-240}" python3 bench/tile_probe.py --tma-only --shapes "$SHAPES" --ns "$NS" \
  --json "$OUT/tma_probe.json" >"$OUT/tma_probe.log" 2>&1
note "# probe rc=$? $(elapsed)"
grep -E "^# (device|nt)" "$OUT/tma_probe.log" | head -12

m=smsp__average_warps_issue_stalled
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active
metrics+=,launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__grid_size,launch__block_size
metrics+=,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
for r in long_scoreboard short_scoreboard mio_throttle math_pipe_throttle barrier wait \
    not_selected dispatch_stall lg_throttle branch_resolving sleeping no_instruction membar; do
  metrics+=",${m}_${r}_per_issue_active.ratio"
done
timeout "${NCU_TIMEOUT:-120}" ncu --clock-control none -k "regex:q6k_(tma|ks|wg)_f16" --metrics "$metrics" \
  python3 bench/tile_probe.py --tma-only --profile --shapes 4096x14336 --ns "${NCU_NS:-16,64}" \
  --no-torch >"$OUT/ncu_tma.txt" 2>&1
note "# ncu rc=$? $(elapsed)"
grep -E "^# profile|q6k_|duration|dram__|issue_active|warps_active|registers|shared_mem|grid_size|inst_executed|bank_conf|stalled" \
  "$OUT/ncu_tma.txt" | sed -E "s/${m}_//; s/_per_issue_active.ratio//" | awk '{$1=$1};1' \
  | cut -c1-120 >"$OUT/ncu_short.txt"
head -90 "$OUT/ncu_short.txt"

# the table: per shape and N, AUTO and torch, then each TMA launch shape (us, TB/s, x AUTO)
python3 - "$OUT/tma_probe.json" <<'EOF' | tee "$OUT/table.txt"
import json, sys
d = json.load(open(sys.argv[1]))
print(f"# {d['device']} {d['date']}: us (TB/s of Q6_K); xA = AUTO/us; err, bits = SoA/AoS/repeat")
for r in d["results"]:
    mb, a, t = r["mb"], r["auto_us"], r["torch_us"]
    ts = f"{t:7.1f}" if t else "      -"
    print(f"{r['shape']:>12} N={r['n']:<3} AUTO {a:7.1f} ({mb / a:.2f}) torch {ts}  {r['auto']}")
    for lab, v in r["tiles"].items():
        if "error" in v:
            print(f"{'':>18} {lab:>22} FAILED {v['error']}")
            continue
        bits = "ok" if v["aos_identical"] and v["repeat_identical"] else "DIFF"
        print(f"{'':>18} {lab:>22} {v['us']:7.1f} ({mb / v['us']:.2f}) xA {a / v['us']:.2f} "
              f"xT {(t or 0) / v['us']:.2f} err {v['err']:.1e} {bits}")
EOF
echo "# tmatest rc=$test_rc  total $(elapsed)"
tar czf "$FINAL/k_tma_logs.tgz" -C "$OUT" . 2>/dev/null
cp "$OUT/table.txt" "$OUT/ncu_short.txt" "$OUT/pytest_tma.log" "$FINAL/" 2>/dev/null
exit 0
