#!/usr/bin/env bash
# Session 17, issue 15, bundle C. T2's slowest 1% wait mostly for their front end's loop (bundle
# B: `up` 2.1-4.0 ms of 6.3-7.5, each of 6 front ends 0.84-0.88 busy at ~1.1 cores): T2 (64
# callers of N=1 on ffn_down, bytes, 16 load processes of 4 callers, round robin) at 6, 7 and 8
# front ends alternated (6 7 8 8 7 6), and T3 (8 hosts of N=64, system and CUDA IPC regions, 6
# front ends) twice more at this tree (CUDA-region calls pipelined in the device process). No run
# starts past BOUND - NEED s; a table last.
#   bench/gpu_dataplane_s17c.sh   env: BOUND (95), NEED (12), SECONDS_PER_RUN (2.0),
#                                 BACKEND (cuda; numpy: a CPU rehearsal with DRY_RUN=1, ROW_SCALE)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp17c
BOUND=${BOUND:-95} S=${SECONDS_PER_RUN:-2.0} BACKEND=${BACKEND:-cuda}
export Q6SERVE_FRONTEND_ROUND_ROBIN=1
one() {  # one RUN NAME: bench/service.py, TGT (T2|T3) and FE from ab_runs
  local args=(--targets T2 --regions bytes --t2-procs 16 --seconds "$S")
  [[ $TGT == T3 ]] && args=(--targets T3 --regions system --t3-hosts 8 --seconds 1.0)
  [[ $TGT == T3 && $BACKEND == cuda ]] && args+=(--cuda-regions)
  timeout "$(bound 30 4)" python3 bench/service.py --backend "$BACKEND" --dataplane \
    --modes stream --frontends "$FE" --warmup 0.5 "${args[@]}" \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/dp_$1.json" >"$OUT/dp_$1.log" 2>&1
  note "# $1 ($TGT, $FE front ends) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
ab_runs "${NEED:-12}" one fe6:TGT=T2,FE=6 fe7:TGT=T2,FE=7 fe8:TGT=T2,FE=8 t3:TGT=T3,FE=6 \
  fe8:TGT=T2,FE=8 fe7:TGT=T2,FE=7 fe6:TGT=T2,FE=6 t3:TGT=T3,FE=6
python3 - "$OUT" <<'PY' | table
import glob, json, sys
print("# run       target x/y via   rows/s     p99 us  fraction")
for path in sorted(glob.glob(f"{sys.argv[1]}/dp_*.json")):
    for t in json.load(open(path))["targets"]:
        rps = t.get("rows_per_s", t.get("service_rows_per_s", 0.0))
        print(f"# {path.rsplit('dp_', 1)[1][:-5]:9} {t['target']:6} {t['region']:7}"
              f" {rps:>10,.0f} {t['p99_us']:>10,.0f} {t.get('fraction', 0):>9.2f}")
PY
