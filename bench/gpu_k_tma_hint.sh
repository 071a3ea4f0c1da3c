#!/usr/bin/env bash
# One device call (issue 16, session 9, helper k): the TMA-fed tile's waits with and without a
# suspend-time hint (Q6SERVE_TMA_HINT=1: mbarrier.try_wait with a 10 ms hint in the 2D form),
# on one machine. Its GPU tests with the hint (slices, slabs, bit-identity to q6k_ks_f16); then
# bench/tile_probe.py --tma-only without and with the hint (AUTO and torch beside), and Nsight
# Compute metrics of the TMA launches at N=16 on 4096x14336 with the hint. Table last.
#   bench/gpu_k_tma_hint.sh   (env: SHAPES, NS)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/k_tma_hint
note "# setup $(elapsed)"
SHAPES=${SHAPES:-4096x14336,3584x18944,152064x3584}
NS=${NS:-16,32}
Q6SERVE_TMA_HINT=1 timeout 100 python3 -m pytest -m gpu -q -rfE --maxfail=3 -p no:cacheprovider \
  tests/kernels/test_cuda_tma.py -k "bit_identical or boxes or slabs" >"$OUT/pytest_hint.log" 2>&1
test_rc=$?
tail -3 "$OUT/pytest_hint.log"
note "# hint tests rc=$test_rc $(elapsed)"
[[ $test_rc == 124 || $test_rc == 137 ]] && { tar czf "$FINAL/k_tma_hint_logs.tgz" -C "$OUT" .; exit 1; }
for h in 0 1; do
  Q6SERVE_TMA_HINT=$h timeout 120 python3 bench/tile_probe.py --tma-only --shapes "$SHAPES" --ns "$NS" \
    --json "$OUT/probe_hint$h.json" >"$OUT/probe_hint$h.log" 2>&1
  note "# probe hint=$h rc=$? $(elapsed)"
done
m=smsp__average_warps_issue_stalled
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active
metrics+=,smsp__inst_executed.sum,launch__grid_size
for r in long_scoreboard short_scoreboard math_pipe_throttle wait not_selected sleeping branch_resolving; do
  metrics+=",${m}_${r}_per_issue_active.ratio"
done
Q6SERVE_TMA_HINT=1 timeout 80 ncu --clock-control none -k "regex:q6k_tma_f16" --metrics "$metrics" \
  python3 bench/tile_probe.py --tma-only --profile --shapes 4096x14336 --ns 16 --no-torch \
  >"$OUT/ncu_hint.txt" 2>&1
note "# ncu rc=$? $(elapsed)"
grep -E "q6k_|duration|dram__|issue_active|warps_active|inst_executed|grid_size|stalled" "$OUT/ncu_hint.txt" \
  | sed -E "s/${m}_//; s/_per_issue_active.ratio//" | awk '{$1=$1};1' | cut -c1-100 | tee "$OUT/ncu_short.txt" | head -80
python3 - "$OUT/probe_hint0.json" "$OUT/probe_hint1.json" <<'PY' | tee "$OUT/table.txt"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
print(f"# {a['device']} {a['date']}: us (x AUTO of the same run); hint = try_wait suspend hint")
for r0, r1 in zip(a["results"], b["results"]):
    print(f"{r0['shape']:>12} N={r0['n']:<3} AUTO {r0['auto_us']:7.1f} / {r1['auto_us']:7.1f}  "
          f"torch {r0['torch_us'] or 0:7.1f}")
    for lab, v0 in r0["tiles"].items():
        v1 = r1["tiles"].get(lab, {})
        if "us" not in v0 or "us" not in v1:
            print(f"{'':>18} {lab:>22} FAILED")
            continue
        ok = "ok" if v1.get("ok") and v0.get("ok") else "BAD"
        print(f"{'':>18} {lab:>22} {v0['us']:7.1f} (x{r0['auto_us'] / v0['us']:.2f})  hint "
              f"{v1['us']:7.1f} (x{r1['auto_us'] / v1['us']:.2f})  {ok}")
PY
echo "# hint tests rc=$test_rc total $(elapsed)"
tar czf "$FINAL/k_tma_hint_logs.tgz" -C "$OUT" . 2>/dev/null
cp "$OUT/table.txt" "$OUT/ncu_short.txt" "$FINAL/" 2>/dev/null
exit 0
