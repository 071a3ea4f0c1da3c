#!/usr/bin/env bash
# Session 17, issue 15, bundle A: decide Q6SERVE_DEVICE_PIPELINE (off by default; session 16's
# bundles A and B disagreed on T3 through regions with two pairs each). More alternations, in
# the order off on on off ... so a drift of the host weighs on both sides alike: T3 (8 hosts of
# N=64 on ffn_down, 6 front ends with round robin, system and CUDA IPC regions in one worker) and
# T2 (64 callers of N=1, bytes). No run starts past BOUND - NEED s; a table last, one line per
# target and run, then each side's median.
#   bench/gpu_dataplane_s17a.sh   env: BOUND (95), SECONDS_PER_RUN (1.0), NEED (12),
#                                 BACKEND (cuda; numpy: a CPU rehearsal with DRY_RUN=1, ROW_SCALE)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp17a
BOUND=${BOUND:-95} S=${SECONDS_PER_RUN:-1.0} BACKEND=${BACKEND:-cuda}
run() {  # run RUN NAME: one bench/service.py --dataplane; TGT (T2|T3) and Q6SERVE_* from ab_runs
  local cuda=() regions=bytes
  [[ $TGT == T3 ]] && regions=system
  [[ $BACKEND == cuda && $TGT == T3 ]] && cuda=(--cuda-regions)
  env Q6SERVE_FRONTEND_ROUND_ROBIN=1 timeout "$(bound 30 4)" \
    python3 bench/service.py --backend "$BACKEND" --dataplane --modes stream --frontends 6 \
    --t3-hosts 8 --seconds "$S" --warmup 0.3 --targets "$TGT" --regions "$regions" "${cuda[@]}" \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/dp_$1.json" >"$OUT/dp_$1.log" 2>&1
  note "# $1 ($TGT, pipeline ${Q6SERVE_DEVICE_PIPELINE:-default}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
N=${NEED:-12}
ab_runs "$N" run t3off:TGT=T3,Q6SERVE_DEVICE_PIPELINE=0 t3on:TGT=T3,Q6SERVE_DEVICE_PIPELINE=1 \
  t2on:TGT=T2,Q6SERVE_DEVICE_PIPELINE=1 t2off:TGT=T2,Q6SERVE_DEVICE_PIPELINE=0 \
  t3on:TGT=T3,Q6SERVE_DEVICE_PIPELINE=1 t3off:TGT=T3,Q6SERVE_DEVICE_PIPELINE=0 \
  t2off:TGT=T2,Q6SERVE_DEVICE_PIPELINE=0 t2on:TGT=T2,Q6SERVE_DEVICE_PIPELINE=1 \
  t3off:TGT=T3,Q6SERVE_DEVICE_PIPELINE=0 t3on:TGT=T3,Q6SERVE_DEVICE_PIPELINE=1 \
  t3on:TGT=T3,Q6SERVE_DEVICE_PIPELINE=1 t3off:TGT=T3,Q6SERVE_DEVICE_PIPELINE=0
python3 - "$OUT" <<'PY' | table
import glob, json, statistics, sys
out = sys.argv[1]
rows: dict[tuple[str, str, str], list[float]] = {}
print("# run       target x/y via   rows/s     p99 us  fraction")
for path in sorted(glob.glob(f"{out}/dp_*.json")):
    tag = path.rsplit("dp_", 1)[1][:-5]
    for t in json.load(open(path))["targets"]:
        rps = t.get("rows_per_s", t.get("service_rows_per_s", 0.0))
        print(f"# {tag:9} {t['target']:6} {t['region']:7} {rps:>10,.0f} {t['p99_us']:>10,.0f}"
              f" {t.get('fraction', 0):>9.2f}")
        side = "on" if "on" in tag.split("_")[0] else "off"
        rows.setdefault((t["target"], t["region"], side), []).append(rps)
print("# median rows/s (runs): target x/y via  off  on  on/off")
for tgt, reg in sorted({(k[0], k[1]) for k in rows}):
    off, on = rows.get((tgt, reg, "off"), []), rows.get((tgt, reg, "on"), [])
    if off and on:
        mo, mn = statistics.median(off), statistics.median(on)
        print(f"# {tgt} {reg:7} {mo:>10,.0f} ({len(off)}) {mn:>10,.0f} ({len(on)}) {mn / mo:6.3f}"
              f"  wins on: {sum(a > b for a, b in zip(on, off))}/{min(len(on), len(off))} pairs")
PY
