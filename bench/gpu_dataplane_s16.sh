#!/usr/bin/env bash
# Session 16, issue 15: Q6SERVE_DEVICE_PIPELINE (the device process launches each trip's calls,
# lone or merged, bytes or region, behind the launches out and waits for them a loop trip later)
# on the H200. 1. `pytest -m gpu tests/dataplane` with the pipeline off, then on. 2. The A/B:
# bench/gpu_dataplane_run.sh once per run, variants 6rr:p0 and 6rr:p1 alternated (PAIRS pairs,
# default 2; T2 64 callers N=1 and T3 8 hosts N=64 on ffn_down, 6 front ends with round robin;
# bytes, system and CUDA regions), each run's archive in $OUT/runI/, the test logs and each
# run's output in $OUT/dataplane_s16.tgz; every run's table rows last. About 10 s + 2 x 22 s + ~18 s a run at SECONDS_PER_RUN=1.0 (H200, session 16's first
# call: 22 s a run at 1.5).
#   bench/gpu_dataplane_s16.sh   env: PAIRS (2), SECONDS_PER_RUN (1.0), BUDGET_S (145: no run
#                                starts past BUDGET_S - 30 s, each is cut at 35 s)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp16
for p in 0 1; do
  Q6SERVE_DEVICE_PIPELINE=$p timeout 40 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/dataplane >"$OUT/pytest_dataplane_gpu_pipeline$p.log" 2>&1
  note "# gpu tests, pipeline $p: rc=$? ($(tail -1 "$OUT/pytest_dataplane_gpu_pipeline$p.log")) at $(elapsed)"
done
i=0
for ((pair = 0; pair < ${PAIRS:-2}; pair++)); do
  for v in 6rr:p0 6rr:p1; do
    (($(date +%s) - T0 > ${BUDGET_S:-145} - 30)) && { note "# run $i ($v) skipped: budget"; break 2; }
    # (a session of its own: installed already; its archive goes to $FINAL/run$i)
    OUT=$FINAL/run$i SKIP_INSTALL=1 SKIP_TESTS=1 SKIP_PROBES=1 VARIANTS=$v \
      SECONDS_PER_RUN=${SECONDS_PER_RUN:-1.0} timeout 35 bash bench/gpu_dataplane_run.sh \
      >"$OUT/run$i.txt" 2>&1
    note "# run $i ($v) at $(elapsed)"
    i=$((i + 1))
  done
done
tar czf "$FINAL/dataplane_s16.tgz" -C "$OUT" .
echo "# run  target variant   x/y via   rows/s      p99 us  kernel rows/s  fraction  met"
for ((j = 0; j < i; j++)); do grep "^# T[23] " "$OUT/run$j.txt" | sed "s/^# /# $j    /"; done
exit 0  # (a run without rows is in its log, not a failure of the script)
