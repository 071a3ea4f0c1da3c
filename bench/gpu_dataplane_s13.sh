#!/usr/bin/env bash
# Issue 15, session 13 (helper dp): who is saturated under T2 on the H200, by front-end count,
# spread and batching policy. T2 = 8 load processes x 8 callers of N=1 (f16) on ffn_down
# 3584x18944; each variant is one worker and one load of bench/t2_timeline.py (the call-by-call
# parts at p50 and over the slowest 1%, and now each worker process's cores and loop-busy share,
# the load processes' cores and the machine's busy cores over the timed part). Alternated; the
# script skips what would end past BUDGET_S and prints a table last.
#   bench/gpu_dataplane_s13.sh   env: SECONDS_PER_RUN (2), BUDGET_S (95), VARIANTS (below)
#   DRY_RUN=1 BACKEND=numpy ROWS=16 K=256 OUT=/tmp/o bench/gpu_dataplane_s13.sh   (CPU)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps13
S=${SECONDS_PER_RUN:-2} BUDGET=${BUDGET_S:-95}
BACKEND=${BACKEND:-cuda} ROWS=${ROWS:-3584} K=${K:-18944}
# TAG:FRONTENDS[:ENV=VALUE,...]  (rr = Q6SERVE_FRONTEND_ROUND_ROBIN=1)
VARIANTS=${VARIANTS:-"f4:4 f8rr:8:Q6SERVE_FRONTEND_ROUND_ROBIN=1 f4rr:4:Q6SERVE_FRONTEND_ROUND_ROBIN=1 \
f8rrnospin:8:Q6SERVE_FRONTEND_ROUND_ROBIN=1,Q6SERVE_BUSY_POLL_US=0 f4st0:4:Q6SERVE_FRONTEND_STACKS=0 \
f6rr:6:Q6SERVE_FRONTEND_ROUND_ROBIN=1 f4b:4"}
archive() { tar czf "$FINAL/dataplane_s13.tgz" -C "$OUT" .; }
left() { (($(date +%s) - T0 + $1 < BUDGET)); }  # left SECONDS: still inside the budget
t2() {  # t2 TAG FRONTENDS ENVS
  left $((9 + S)) || { note "# t2 $1 skipped at $(elapsed)"; return; }
  local limit=$((25 + S)) rest=$((BUDGET + T0 - $(date +%s)))
  ((rest < limit)) && limit=$rest  # (never past the budget: a bundle's bound)
  local envs=()
  [[ -n $3 ]] && IFS=, read -ra envs <<<"$3"
  (cd bench && env "${envs[@]}" timeout "$limit" python3 t2_timeline.py --backend "$BACKEND" \
    --rows "$ROWS" --k "$K" --frontends "$2" --hosts 8 --callers 8 --seconds "$S" \
    --warmup 0.3 --runs 1 --json "$OUT/t2_$1.json" --keep "$OUT/keep_$1" >"$OUT/t2_$1.log" 2>&1)
  note "# t2 $1 (F=$2 ${3:-defaults}) rc=$? at $(elapsed)"
  grep -E "^run|^\| (p|band)|^cores|^load" "$OUT/t2_$1.log" | cut -c1-400
  archive
}
for v in $VARIANTS; do
  IFS=: read -r tag fe envs <<<"$v"
  t2 "$tag" "$fe" "${envs:-}"
done
archive
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print("| variant | calls/s | p50 / p99 / p99.9 ms | up p50 / slow 1% us | device loop busy | front ends cores (loop busy max) | load cores | machine busy |")
print("|---|---|---|---|---|---|---|---|")
for p in sorted(Path(sys.argv[1]).glob("t2_*.json"), key=lambda p: p.stat().st_mtime):
    r = json.loads(p.read_text())
    u = r.get("usage", {})
    dev = [v for k, v in u.items() if k.startswith("device")]
    fe = [v for k, v in u.items() if k.startswith("front")]
    print(f"| {p.stem[3:]} | {r['calls_per_s']:,.0f} | {r['p50_us']/1e3:.2f} / {r['p99_us']/1e3:.2f} / "
          f"{r['p999_us']/1e3:.2f} | {r['p50']['up']:,.0f} / {r['p99']['up']:,.0f} | "
          f"{dev[0]['loop_busy']:.2f} | " if dev else "| - | ", end="")
    print(f"{sum(v['cores'] for v in fe):.2f} ({max((v['loop_busy'] for v in fe), default=0):.2f}) | "
          f"{sum(r.get('load_cores', [])):.2f} | {r.get('machine_cores', 0):.1f} of {r.get('machine_cpus')} |")
PY
