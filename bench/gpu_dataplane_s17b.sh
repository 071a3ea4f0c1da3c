#!/usr/bin/env bash
# Session 17, issue 15, bundle B. 1. `pytest -m gpu tests/dataplane` (CUDA-region calls now always
# pipelined in the device process, bytes and system regions inline). 2. T3 (8 hosts of N=64,
# system and CUDA IPC regions, 6 front ends round robin) once at this tree. 3. Where T2's p99
# comes from on the H200 (64 callers of N=1 on
# ffn_down, 6 front ends with round robin), and whether the load generator's own loops are part
# of it: the same 64 callers as 8 load processes of 8 callers (bench/service.py's default) and as
# 16 processes of 4, alternated (8 16 16 8 ...), each side measured by bench/t2_timeline.py (a
# per-call timeline: up / device / down ... at p50 and over the slowest 1%, GC pauses and long
# loop iterations of each process) and by bench/service.py's T2 (rows/s, p99, the target's own
# measure). No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dataplane_s17b.sh   env: BOUND (95), NEED (14), SECONDS_PER_RUN (2.0),
#                                 BACKEND (cuda; numpy: a CPU rehearsal with DRY_RUN=1, ROWS/K)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp17b
BOUND=${BOUND:-95} S=${SECONDS_PER_RUN:-2.0} BACKEND=${BACKEND:-cuda}
export Q6SERVE_FRONTEND_ROUND_ROBIN=1
tl() {  # tl RUN NAME: bench/t2_timeline.py, HOSTS x CALLERS (from ab_runs)
  timeout "$(bound 40 4)" python3 bench/t2_timeline.py --backend "$BACKEND" \
    --rows "${ROWS:-3584}" --k "${K:-18944}" --frontends 6 --hosts "$HOSTS" \
    --callers "$CALLERS" --seconds "$S" --warmup 0.5 --json "$OUT/tl_$1.json" \
    >"$OUT/tl_$1.log" 2>&1
  note "# $1 (t2_timeline ${HOSTS}x$CALLERS) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
sv() {  # sv RUN NAME: bench/service.py's T2 (bytes) with HOSTS load processes
  timeout "$(bound 40 4)" python3 bench/service.py --backend "$BACKEND" --dataplane \
    --modes stream --frontends 6 --seconds "$S" --warmup 0.5 --targets T2 --regions bytes \
    --t2-procs "$HOSTS" --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/sv_$1.json" \
    >"$OUT/sv_$1.log" 2>&1
  note "# $1 (service.py T2, $HOSTS load processes) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
N=${NEED:-14}
if left 50; then
  timeout "$(bound 45 4)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/dataplane \
    >"$OUT/pytest_dataplane_gpu.log" 2>&1
  note "# gpu tests rc=$? ($(tail -1 "$OUT/pytest_dataplane_gpu.log")) at $(elapsed)"
fi
t3() {  # t3 RUN NAME: bench/service.py's T3 through system and CUDA regions
  local cuda=()
  [[ $BACKEND == cuda ]] && cuda=(--cuda-regions)
  timeout "$(bound 30 4)" python3 bench/service.py --backend "$BACKEND" --dataplane \
    --modes stream --frontends 6 --t3-hosts 8 --seconds 1.0 --warmup 0.3 --targets T3 \
    --regions system "${cuda[@]}" --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t3_$1.json" \
    >"$OUT/t3_$1.log" 2>&1
  note "# $1 (service.py T3) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
one() { "$TOOL" "$@"; }  # one RUN NAME: tl or sv, as the variant says
T8=TOOL=tl,HOSTS=8,CALLERS=8 T16=TOOL=tl,HOSTS=16,CALLERS=4 S8=TOOL=sv,HOSTS=8 S16=TOOL=sv,HOSTS=16
ab_runs "$N" one "t3:TOOL=t3" "tl8:$T8" "tl16:$T16" "sv16:$S16" "sv8:$S8" "tl16:$T16" "tl8:$T8" \
  "sv8:$S8" "sv16:$S16"
{
  echo "# t2_timeline runs (calls/s, p50 / p99 / p99.9, then the parts at p50 and the slowest 1%):"
  for f in "$OUT"/tl_*.log; do
    [[ -f $f ]] || continue
    echo "## ${f##*/}"
    grep -E "^run 0|^\| (band|p50|p99)|^per front end|^stalls|^cores|^load" "$f" | cut -c1-400
  done
  echo "# service.py T2 (bytes) and T3, 6 front ends round robin: run, rows/s, p99 us, fraction"
  python3 - "$OUT" <<'PY'
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/sv_*.json") + glob.glob(f"{sys.argv[1]}/t3_*.json")):
    for t in json.load(open(path))["targets"]:
        rps = t.get("rows_per_s", t.get("service_rows_per_s", 0.0))
        print(f"# {path.rsplit('/', 1)[1][:-5]:11} {t['target']} {t['region']:6}"
              f" {rps:>10,.0f} {t['p99_us']:>9,.0f} {t.get('fraction', 0):6.2f}")
PY
} | table
