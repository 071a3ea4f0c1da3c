#!/usr/bin/env bash
# One GPU session for issue 15, session 7: short batches launched behind each other
# (Q6SERVE_PIPELINE_SHORT=1). On one machine this tree ("new", PIPELINE_SHORT=1; "new0": the
# same tree with it off) against OLD (a copy of main, installed in turn with pip -e):
#   T3: bench/service.py --dataplane --targets T3 --regions system --cuda-regions (8 hosts x
#       N=64 on ffn_down, x/y in page-locked shm regions and in CUDA IPC buffers) per F in
#       FRONTENDS;
#   T2: --targets T2 --regions bytes,system (64 callers x N=1) per F in T2_FRONTENDS;
# then the new tree's T3 at the last F again (drift), with PROFILE=1 the device process of
# the new tree under T3 (bench/frontend_cpu.py --profile, py-spy from .whl), the A/B's table;
# then the GPU tests of tests/dataplane (CUDA IPC and page-locked regions, the pipelined region
# calls). $OUT gets one archive of every log and JSON (written after the A/B and at the end).
#   OLD=../dp_old bench/gpu_dataplane_s7.sh
#   env: SECONDS_PER_RUN (1.5), FRONTENDS ("1 4"), T2_FRONTENDS ("4"), NEW0 (""), PROFILE (""),
#        SKIP_TESTS, TESTS_TIMEOUT (120), BACKEND (cuda; numpy + ROW_SCALE: a dry run on a CPU)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps7
S=${SECONDS_PER_RUN:-1.5}
B=${BACKEND:-cuda}
SCALE=${ROW_SCALE:-1}
NEW=$PWD
OLD=${OLD:+$(cd "$OLD" && pwd)}
use() { (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1); }
bench() {  # $1 tag, $2 tree, $3 PIPELINE_SHORT, $4 front ends, $5 targets, $6 regions, rest: more
  local tag=$1 tree=$2 p=$3 f=$4 t=$5 r=$6
  shift 6
  (cd "$tree" && Q6SERVE_PIPELINE_SHORT=$p timeout 90 python3 bench/service.py --backend "$B" \
    --row-scale "$SCALE" --dataplane --targets "$t" --regions "$r" "$@" --modes stream \
    --frontends "$f" --t3-hosts 8 --seconds "$S" --warmup 0.3 --json "$OUT/dp_$tag.json") \
    >"$OUT/dp_$tag.log" 2>&1
  echo "# $tag rc=$? at $(elapsed)"
  mv "$OUT/worker.log" "$OUT/worker_$tag.log" 2>/dev/null
}
trees=("new:$NEW:1")
[[ -n ${NEW0:-} ]] && trees+=("new0:$NEW:0")
[[ -n $OLD ]] && trees+=("old:$OLD:0")
for spec in "${trees[@]}"; do
  IFS=: read -r name tree p <<<"$spec"
  [[ $tree == "$NEW" ]] || use "$tree"
  for F in ${FRONTENDS:-1 4}; do
    bench "t3_${name}_f$F" "$tree" "$p" "$F" T3 system --cuda-regions
  done
  for F in ${T2_FRONTENDS:-4}; do
    bench "t2_${name}_f$F" "$tree" "$p" "$F" T2 bytes,system
  done
  [[ $tree == "$NEW" ]] || use "$NEW"
done
lastF=$(echo "${FRONTENDS:-1 4}" | awk '{print $NF}')
bench "t3_new_f${lastF}_again" "$NEW" 1 "$lastF" T3 system --cuda-regions
if [[ -n ${PROFILE:-} ]]; then
  PYSPY=$(command -v py-spy || true)
  if [[ -z $PYSPY ]] && ls .whl/py_spy*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --target /tmp/spy .whl/py_spy*.whl && PYSPY=/tmp/spy/bin/py-spy
  fi
  Q6SERVE_PIPELINE_SHORT=1 PYSPY=$PYSPY timeout 60 python3 bench/frontend_cpu.py --backend "$B" \
    --rows 3584 --k 18944 --n 64 --region system --frontends 4 --hosts 8 --callers 1 \
    --seconds 3 --warmup 1 --profile "$OUT/prof" --json "$OUT/prof/result.json" \
    >"$OUT/prof.log" 2>&1
  echo "# profile rc=$? at $(elapsed)"; grep -v "^#   per call" "$OUT/prof.log" | tail -3 | cut -c1-250
  [[ -f $OUT/prof/pyspy.txt ]] && timeout 30 python3 bench/spy_summary.py "$OUT/prof/pyspy.txt" \
    --top 45 >"$OUT/prof/summary.txt" 2>&1 && head -60 "$OUT/prof/summary.txt" | cut -c1-150
fi
grep -h "FAILED\|Traceback" "$OUT"/dp_*.log "$OUT"/worker_*.log 2>/dev/null | sort | uniq -c | head -5
python3 bench/dataplane_table.py "$OUT"
tar czf "$FINAL/dataplane_s7.tgz" -C "$OUT" .  # (the A/B first: a cut-off call keeps it)
if [[ -z ${SKIP_TESTS:-} ]]; then
  timeout "${TESTS_TIMEOUT:-120}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/dataplane \
    >"$OUT/pytest_dataplane_gpu.log" 2>&1
  echo "# gpu tests rc=$? ($(tail -1 "$OUT/pytest_dataplane_gpu.log")) at $(elapsed)"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest_dataplane_gpu.log" | head -8 | cut -c1-240
fi
tar czf "$FINAL/dataplane_s7.tgz" -C "$OUT" .
python3 bench/dataplane_table.py "$OUT"
echo "# done at $(elapsed)"
