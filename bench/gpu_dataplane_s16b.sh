#!/usr/bin/env bash
# Session 16, issue 15, bundle B: Q6SERVE_DEVICE_PIPELINE (on by default since this session) again.
# 1. `pytest -m gpu tests/dataplane` (the default: on). 2. T3 (8 hosts of N=64 on ffn_down, 6
# front ends with round robin, system and CUDA IPC regions) with the pipeline on and off
# alternated (PAIRS pairs, default 2). 3. T2 bytes (64 callers of N=1) one pair. 4. One more T3
# run, pipeline on, with Q6SERVE_DP_STATS: the device process's counters every second (its
# loop's share in epoll, calls, waits): is its loop what bounds T3 now? (the counters cost
# loop time: not in the A/B). No step starts past BUDGET_S - 15 s; a table last.
#   bench/gpu_dataplane_s16b.sh   env: PAIRS (2), SECONDS_PER_RUN (1.0), BUDGET_S (115),
#                                 BACKEND (cuda; numpy: a CPU rehearsal with DRY_RUN=1)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp16b
S=${SECONDS_PER_RUN:-1.0} BACKEND=${BACKEND:-cuda}
left() { (($(date +%s) - T0 + $1 < ${BUDGET_S:-115})); }  # left SECONDS: inside the budget
run() {  # run TAG PIPELINE TARGETS REGIONS [ENV=VALUE]: one bench/service.py --dataplane
  left 15 || { note "# $1 skipped at $(elapsed)"; return; }
  local cuda=()
  [[ $BACKEND == cuda && $3 == T3 ]] && cuda=(--cuda-regions)
  env Q6SERVE_FRONTEND_ROUND_ROBIN=1 Q6SERVE_DEVICE_PIPELINE="$2" ${5:+"$5"} timeout 40 \
    python3 bench/service.py --backend "$BACKEND" --dataplane --modes stream --frontends 6 \
    --t3-hosts 8 --seconds "$S" --warmup 0.3 --targets "$3" --regions "$4" "${cuda[@]}" \
    --json "$OUT/dp_$1.json" >"$OUT/dp_$1.log" 2>&1
  note "# $1 (pipeline $2, $3 $4) rc=$? at $(elapsed)"
}
if left 40; then
  timeout 40 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/dataplane \
    >"$OUT/pytest_dataplane_gpu.log" 2>&1
  note "# gpu tests (pipeline default) rc=$? ($(tail -1 "$OUT/pytest_dataplane_gpu.log")) at $(elapsed)"
fi
for ((i = 0; i < ${PAIRS:-2}; i++)); do
  run "t3_on$i" 1 T3 system
  run "t3_off$i" 0 T3 system
done
run t2_on 1 T2 bytes
run t2_off 0 T2 bytes
run t3_stats 1 T3 system "Q6SERVE_DP_STATS=$OUT/dpstats.jsonl"
tar czf "$FINAL/dataplane_s16b.tgz" -C "$OUT" .
python3 - "$OUT" <<'PY'
import glob, json, sys
out = sys.argv[1]
print("# run        target x/y via   rows/s     p99 us  kernel rows/s  fraction")
for path in sorted(glob.glob(f"{out}/dp_*.json")):
    tag = path.rsplit("dp_", 1)[1][:-5]
    for t in json.load(open(path))["targets"]:
        rps = t.get("rows_per_s", t.get("service_rows_per_s", 0.0))
        print(f"# {tag:10} {t['target']:6} {t['region']:7} {rps:>10,.0f} {t['p99_us']:>10,.0f}"
              f" {t.get('kernel_rows_per_s', 0):>13,.0f} {t.get('fraction', 0):>9.2f}")
try:  # the device process's counters, second by second (deltas): loop share in epoll
    lines = [json.loads(x) for x in open(f"{out}/dpstats.jsonl")]
except OSError:
    lines = []
print("# dp stats: s  rm_calls/s  epoll_share  cpu_share  pipelined/s  wait_share")
for a, b in zip(lines, lines[1:]):
    dt = b["t"] - a["t"]
    d = lambda k: (b.get(k, 0) - a.get(k, 0)) / dt
    print(f"# {b['t']:8.1f} {d('msg_rm'):10,.0f} {d('select_s'):11.2f} {d('cpu_s'):10.2f}"
          f" {d('pipelined_batches'):11,.0f} {d('pipelined_wait_s'):10.2f}")
PY
