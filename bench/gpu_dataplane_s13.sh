#!/usr/bin/env bash
# Issue 15, session 13 (helper dp): who is saturated under T2 on the H200, by front-end count,
# spread and batching policy. T2 = 8 load processes x 8 callers of N=1 (f16) on ffn_down
# 3584x18944; each variant is one worker and one load of bench/t2_timeline.py (the call-by-call
# parts at p50 and over the slowest 1%, and now each worker process's cores and loop-busy share,
# the load processes' cores and the machine's busy cores over the timed part). Alternated; the
# script skips what would end past BUDGET_S and prints a table last. Beside them T3's shape
# through lanes over CUDA IPC regions with and without the lane's pipeline for them
# (Q6SERVE_LANE_CUDA_PIPELINE=1, off by default), and its GPU test.
#   bench/gpu_dataplane_s13.sh   env: SECONDS_PER_RUN (2), BUDGET_S (95), VARIANTS (below)
#   DRY_RUN=1 BACKEND=numpy ROWS=16 K=256 OUT=/tmp/o bench/gpu_dataplane_s13.sh   (CPU)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps13
S=${SECONDS_PER_RUN:-2} BUDGET=${BUDGET_S:-95}
BACKEND=${BACKEND:-cuda} ROWS=${ROWS:-3584} K=${K:-18944}
# TAG:FRONTENDS[:ENV=VALUE,...]  (rr = Q6SERVE_FRONTEND_ROUND_ROBIN=1)
VARIANTS=${VARIANTS:-"f4:4 f8rr:8:Q6SERVE_FRONTEND_ROUND_ROBIN=1 \
f8rrst1:8:Q6SERVE_FRONTEND_ROUND_ROBIN=1,Q6SERVE_FRONTEND_STACKS=1 \
f8rrnospin:8:Q6SERVE_FRONTEND_ROUND_ROBIN=1,Q6SERVE_BUSY_POLL_US=0"}
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
lane() {  # lane TAG ENV [ARGS...]: T3's shape through lanes under ENV (VAR=VALUE), more ARGS
  local tag=$1 var=$2
  shift 2
  left 10 || { note "# lane $tag skipped at $(elapsed)"; return; }
  env "$var" timeout 22 python3 bench/frontend_cpu.py --backend "$BACKEND" --rows "$ROWS" \
    --k "$K" --n 64 --lane --frontends 1 --hosts 8 --callers 4 --seconds "$S" --warmup 0.5 \
    --json "$OUT/lane_$tag.json" "$@" >"$OUT/lane_$tag.log" 2>&1
  note "# lane $tag rc=$? at $(elapsed): $(grep -h "^frontends=" "$OUT/lane_$tag.log" \
    | cut -c1-220)"
  archive
}
gpu_tests() {  # the CUDA-region lane tests (the new pipeline's with Q6SERVE_LANE_CUDA_PIPELINE=1)
  if [[ -n ${DRY_RUN:-} ]] || ! left 14; then
    note "# gpu test skipped at $(elapsed)"
    return
  fi
  timeout 25 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/dataplane/test_cuda_ipc_gpu.py -k "pipelined" >"$OUT/pytest_gpu.log" 2>&1
  note "# gpu test rc=$? ($(tail -1 "$OUT/pytest_gpu.log")) at $(elapsed)"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest_gpu.log" | head -6 | cut -c1-240
}
t2s() { [[ -n ${SKIP_T2:-} ]] || for v in "$@"; do
  IFS=: read -r tag fe envs <<<"$v"
  t2 "$tag" "$fe" "${envs:-}"
done; }
lanes() { [[ $BACKEND == cuda && -z ${SKIP_LANES:-} ]] && for tag in "$@"; do
  lane "$tag" "Q6SERVE_LANE_CUDA_PIPELINE=$([[ $tag == cudapipe* ]] && echo 1 || echo 0)" \
    --region cuda
done; }
# in this order (what the budget cuts is the last): T2's first two variants, T3's shape
# through lanes over CUDA IPC regions with the lane's pipeline for them
# (Q6SERVE_LANE_CUDA_PIPELINE=1) and without (one CudaPlane.start job a request, the
# default), T2's other variants, the pipeline's GPU test, the lanes' second pair
read -ra V <<<"$VARIANTS"
t2s "${V[@]:0:2}"
lanes cudapipe1 cudaone1
t2s "${V[@]:2}"
[[ $BACKEND == cuda && -z ${SKIP_LANES:-} ]] && gpu_tests
lanes cudaone2 cudapipe2
archive
python3 bench/t2_table.py "$OUT"
grep -h "^# lane" "$FINAL/progress.txt" 2>/dev/null | cut -c1-240
