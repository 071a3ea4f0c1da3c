#!/usr/bin/env bash
# Issue 14, session 14, the lead's bundles (bound 90 s in A): the 28-layer decode replay of
# `bench/service.py --replay` (multi-weight calls, lm-head top-64, S = 1 and 8, MatmulStream,
# f16 x and y) with worker variants alternated in one call (bench/replay_ab.py: one worker
# per variant, the model uploaded to each once, then the runs in ORDER).
# Variants: def (the tree's defaults), pipe (Q6SERVE_MULTI_PIPELINE=1: the direct path's parts
# launched behind each other), one (Q6SERVE_MULTI_LAUNCH=1: a multi-weight call's parts as one
# Backend.launch_many: x uploaded once, one sync).
#   bench/gpu_t1_s14.sh   env: VARIANTS ("def: pipe:Q6SERVE_MULTI_PIPELINE=1
#                         one:Q6SERVE_MULTI_LAUNCH=1"), ORDER (def,one,pipe,pipe,one,def),
#                         SEQS (1,8), SECONDS_RUN (1.3), WARMUP (0.2),
#                         BOUND (88: the replay is cut with `timeout` to end by then),
#                         LAYERS (28), RP_EXTRA (more replay_ab.py options)
#   a CPU rehearsal: DRY_RUN=1 BACKEND=numpy LAYERS=2 RP_EXTRA="--scale 0.002" bench/gpu_t1_s14.sh
# $OUT: t1s14.tgz (logs, JSON), summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1s14
BOUND=${BOUND:-88}
left=$((BOUND - $(date +%s) + T0 - 2))
# shellcheck disable=SC2206
EXTRA=(${RP_EXTRA:-})
timeout -k 2 "$left" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
  --variants "${VARIANTS:-def: pipe:Q6SERVE_MULTI_PIPELINE=1 one:Q6SERVE_MULTI_LAUNCH=1}" \
  --order "${ORDER:-def,one,pipe,pipe,one,def}" \
  --seqs "${SEQS:-1,8}" --layers "${LAYERS:-28}" --seconds "${SECONDS_RUN:-1.3}" \
  --warmup "${WARMUP:-0.2}" --bound "$((left - 4))" --out-dir "$OUT" --json "$OUT/replay_ab.json" \
  "${EXTRA[@]}" >"$OUT/replay_ab.log" 2>&1
rc=$?
note "# replay_ab rc=$rc ($(elapsed))"
{
  echo "# gpu_t1_s14 tree $(cat COMMIT 2>/dev/null) rc=$rc ($(elapsed))"
  grep -E "^# [0-9]+ workers|^# the workers|skipped|FAILED" "$OUT/replay_ab.log"
  sed -n '/^# replay A\/B/,$p' "$OUT/replay_ab.log"
  [[ $rc != 0 ]] && tail -5 "$OUT/replay_ab.log"
} >"$OUT/summary.txt" 2>&1
tar czf "$FINAL/t1s14.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
