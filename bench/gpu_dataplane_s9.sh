#!/usr/bin/env bash
# Issue 15, session 9, call 1: what limits T2 (64 callers of N=1 on ffn_down 3584x18944, f16,
# bytes in the messages, a connection per caller) through front ends on the H200 (16 cores
# shared by the front ends, the device process and the load generator). Each variant is one
# worker (`bench/frontend_cpu.py`: front-end count, env) running one or more loads (HOSTSxCALLERS
# load processes x callers each: the load generator's own process count); each load prints
# rows/s, p50/p99 and every process's share of a core in the middle of its timed part (the
# device process, each front end, each load process, the whole machine: who saturates).
# `prof` variants also print the device process's counters (Q6SERVE_DP_STATS: its loop's busy
# share, which busy polling's spin does not inflate). First: bench/service.py's own T2
# (the closing check's command) as the anchor of frontend_cpu's figure; the last F=8 run has
# py-spy on the device process and one front end. A table last.
#   bench/gpu_dataplane_s9.sh   env: SECONDS_PER_RUN (1.5), SKIP_SPY=1
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps9
S=${SECONDS_PER_RUN:-1.5}
T2=(--backend cuda --rows 3584 --k 18944 --n 1 --precision f16 --seconds "$S" --warmup 0.4)
v() {  # v TAG FRONTENDS LOADS [more frontend_cpu.py args]; env: as given before the call
  local tag=$1 f=$2 loads=$3
  shift 3
  timeout 100 python3 bench/frontend_cpu.py "${T2[@]}" --frontends "$f" --loads "$loads" "$@" \
    --json "$OUT/fe_$tag.json" >"$OUT/fe_$tag.log" 2>&1
  note "# $tag rc=$? at $(elapsed)"
  grep -E "^frontends=|^#   cpu|^# device process|^#   threads" "$OUT/fe_$tag.log" \
    | cut -c1-330 | tee -a "$FINAL/progress.txt"
  tar czf "$FINAL/dataplane_s9.tgz" -C "$OUT" .
}
anchor() {
  timeout 60 python3 bench/service.py --backend cuda --dataplane --targets T2 --regions bytes \
    --modes stream --frontends 8 --seconds "$S" --warmup 0.3 --json "$OUT/svc_t2_$1.json" \
    >"$OUT/svc_t2_$1.log" 2>&1
  note "# anchor $1 rc=$? at $(elapsed): $(grep -h "^T2" "$OUT/svc_t2_$1.log" | cut -c1-200)"
}
anchor a
v f8 8 8x8,4x16,16x4 --profile "$OUT/prof_f8"
v f4 4 8x8
v f12 12 8x8
Q6SERVE_BUSY_POLL_US=0 v f8_nospin 8 8x8 --profile "$OUT/prof_f8_nospin"
Q6SERVE_JOB_BATCHES=4 v f8_job4 8 8x8
Q6SERVE_FRONTEND_BUSY_POLL_US=1000 v f8_fespin 8 8x8
Q6SERVE_FRONTEND_BUSY_POLL_US=1000 v f4_fespin 4 8x8
if [[ -z ${SKIP_SPY:-} && -x /tmp/site/bin/py-spy ]]; then
  # the same F=8 8x8 again, py-spy (200 Hz, not stopping the process) on the device process
  # and on one front end for 1 s of the timed part (py-spy takes whole seconds)
  (
    dev=$(worker_pid 80)
    for ((i = 0; i < 80; i++)); do  # the load processes started: their warm-up, then spy
      (($(pgrep -fc "multiprocessing.spawn") >= 8)) && break
      sleep 0.25
    done
    sleep 2.2
    fe=$(pgrep -P "$dev" | head -1)
    for p in "$dev" "$fe"; do
      timeout 10 /tmp/site/bin/py-spy record --pid "$p" --duration 1 --rate 200 --nonblocking \
        -f raw -o "$OUT/spy_$p.txt" >"$OUT/spy_$p.log" 2>&1 &
    done
    echo "device $dev front end $fe" >"$OUT/spy_pids.txt"
    wait
  ) &
  v f8_again_spy 8 8x8
  wait
fi
python3 - "$OUT" <<'EOF' | tee "$FINAL/table.txt"
import glob, json, sys
out = sys.argv[1]
print("# variant      load   rows/s   p50us  p99us | device fe_sum fe_max load_sum load_max"
      " machine | dev_loop_busy")
for path in sorted(glob.glob(f"{out}/fe_*.json")):
    doc = json.load(open(path))
    for r in doc if isinstance(doc, list) else [doc]:
        c = r.get("cpu") or {}
        fe, ld = c.get("fronts", []), c.get("load", [])
        busy = r.get("device", {}).get("loop_busy_share")
        print(f"{path.rsplit('fe_', 1)[1][:-5]:13} {r['hosts']:>2}x{r['callers']:<3}"
              f" {r['rows_per_s']:>7,.0f} {r['p50_us']:>6,.0f} {r['p99_us']:>6,.0f} |"
              f" {c.get('device', 0):5.2f} {sum(fe):6.2f} {max(fe, default=0):5.2f}"
              f" {sum(ld):7.2f} {max(ld, default=0):6.2f} {c.get('machine_busy_cores', 0):6.1f}"
              f" | {'' if busy is None else f'{busy:.2f}'}")
for path in sorted(glob.glob(f"{out}/svc_t2_*.json")):
    for t in json.load(open(path))["targets"]:
        print(f"# bench/service.py T2 {path[-6]}: {t['rows_per_s']:,.0f} rows/s p99 "
              f"{t['p99_us']:,.0f} us")
EOF
tar czf "$FINAL/dataplane_s9.tgz" -C "$OUT" .
echo "# done at $(elapsed)"
