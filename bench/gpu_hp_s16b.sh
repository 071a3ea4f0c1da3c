#!/usr/bin/env bash
# Session 16, helper hp, bundle B (bound 120 s).
# 1. Issue 14's host wall at N=64 (limit: the unsplit kernel + 100 us): backend_wall.py staged +
#    graph on 14336x4096, 18944x3584 and 4096x14336 at N = 64, 48, 32, 1, 3 rounds, one process,
#    alternated: `new` this tree's defaults (X_SPLIT_Y_MIN 3 MiB + X_SPLIT_ROWS: a y that large in
#    token halves x the weight's row chunks) against `off` (X_SPLIT_Y_MIN=0: session 15's row
#    chunks) and `plain` (nothing split: the unsplit kernel the limit is read against); each row's
#    y checked bit for bit against the defaults'. Then the split calls' GPU tests again (the row
#    chunks' and x halves' with the y rule off, the y rule's own).
# 2. The lm-head target in one process (8 callers x N=64 on 152064x3584, top-64, MatmulStream;
#    limit p50 5 ms), `bench/service.py --backend cuda --lm-head --mode stream` 1.2 s runs with a
#    fresh worker each, alternated: `def` this tree's defaults; `gNNN` Q6SERVE_GIL_SWITCH_US=NNN in
#    the worker's environment (the device thread's wait for the GIL behind the busy loop, after
#    each lm-head batch's sync, bounded by that interval instead of Python's 5000 us).
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp16b
timeout 50 python3 bench/backend_wall.py --shapes 14336x4096,18944x3584,4096x14336 \
  --ns 64,48,32,1 --modes staged,graph --calls 100 --rounds 3 --parts \
  --variants 'new;off:X_SPLIT_Y_MIN=0;plain:X_SPLIT_Y_MIN=0,Y_CHUNKS=0,X_SPLIT_MIN=0' \
  --json "$OUT/wall.json" >"$OUT/wall.log" 2>&1
note "wall rc=$? at $(elapsed)"
timeout 40 python3 -m pytest -q -m gpu tests/kernels/test_cuda_backend_host.py \
  tests/service/test_launch_split.py -p no:cacheprovider \
  -k "row_chunks_on_the_gpu or token_halves_on_the_gpu or halves_by_y_on_the_gpu" -rA \
  >"$OUT/tests.log" 2>&1
note "tests rc=$? at $(elapsed): $(tail -1 "$OUT/tests.log")"
for v in ${LM_RUNS:-def g200 g1000 g1000 g200 def}; do
  if (($(date +%s) - T0 > ${BOUND:-110} - 12)); then
    note "lm $v skipped at $(elapsed)"
    continue
  fi
  envs=()
  [[ $v == g* ]] && envs=(Q6SERVE_GIL_SWITCH_US="${v#g}")
  i=$(ls "$OUT" | grep -c "^lm_${v}_")
  env "${envs[@]}" timeout 40 python3 bench/service.py --backend cuda --lm-head --mode stream \
    --seconds "${LM_SECONDS:-1.2}" --warmup 0.3 --json "$OUT/lm_${v}_$i.json" \
    >"$OUT/lm_${v}_$i.log" 2>&1
  note "lm $v rc=$? at $(elapsed): $(grep -E '^lm-head N=' "$OUT/lm_${v}_$i.log" | head -1 | tr -s ' ' | cut -c1-160)"
done
tar czf "$FINAL/hp16b.tgz" -C "$OUT" . 2>/dev/null
echo "## lm-head runs (in order): calls in LM_SECONDS, p50, p99; mean us"
for f in $(ls -tr "$OUT"/lm_*.log); do
  printf '%-12s %s | %s\n' "$(basename "$f" .log)" \
    "$(grep -E '^lm-head N=' "$f" | head -1 | grep -oE '(calls +[0-9]+)|(p50 +[0-9]+ us +p99 +[0-9]+ us)' | tr -s ' ' | tr '\n' ' ')" \
    "$(grep -E 'mean us' "$f" | head -1 | tr -s ' ' | cut -c1-150)"
done
grep -E "^(PASSED|FAILED)" "$OUT/tests.log"; tail -1 "$OUT/tests.log"
grep DIFFERS "$OUT/wall.log"
grep -A24 "^# variants" "$OUT/wall.log" || tail -14 "$OUT/wall.log"
