#!/usr/bin/env bash
# One GPU session for issue 15, session 8: several batches of one weight as one device job
# (Q6SERVE_JOB_BATCHES=N, service/batcher.py) against one job per batch, on one machine, most
# important first (a cut call keeps what ran: $FINAL gets the archive after every step):
#  1. T3's shape through the fast lane (bench/frontend_cpu.py --lane, 8 hosts x N=64 on
#     ffn_down, one process): JOB 1 (today's default), 1 + Q6SERVE_PIPELINE_SHORT=1, 4, 8, 4 + 1;
#  2. T3 through front ends with regions (bench/service.py --dataplane --targets T3 --regions
#     system --cuda-regions) at F=4: JOB 1 and 4;
#  3. the base tree (OLD, main; its code through base_tree's PYTHONPATH): lane plain and
#     pipelined, T3 regions at F=4;
#  4. each host keeping 2 calls in flight (--callers 2): lane JOB 1 pipelined and JOB 4/8;
#     regions through 4 front ends (bench/frontend_cpu.py --region system) JOB 1 and 4;
#  5. pytest -m gpu tests/dataplane; 6. T3 regions at F=1 and F=8, JOB 1 and 4; 7. T2 (64
#     callers N=1, bytes) at F=4, JOB 1 and 4. A short table last.
#   OLD=../dp_old bench/gpu_dataplane_s8.sh
#   env: SECONDS_PER_RUN (1.5), JOBS_BEST (4: the JOB of steps 4, 6, 7), SKIP_TESTS,
#        BACKEND (cuda; numpy + ROW_SCALE=0.01 + K=256: a dry run on a CPU)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps8
S=${SECONDS_PER_RUN:-1.5}
B=${BACKEND:-cuda}
SCALE=${ROW_SCALE:-1}
J=${JOBS_BEST:-4}
ROWS=$(python3 -c "print(max(1, round(3584 * $SCALE)))")
K=${K:-18944}  # (a dry run on a CPU: K=256 keeps the NumPy kernel cheap)
[[ -n ${OLD:-} ]] && base_tree "$OLD"
NOWPP=${PYTHONPATH:-}
pp() { [[ $1 == old ]] && echo "$BASEPP" || echo "$NOWPP"; }
save() { tar czf "$FINAL/dataplane_s8.tgz" -C "$OUT" .; }
fe_cpu() {  # $1 tag, $2 tree (new|old), $3 JOB, $4 PIPE, rest: frontend_cpu.py arguments
  local tag=$1 tree=$2 j=$3 p=$4
  shift 4
  PYTHONPATH=$(pp "$tree") Q6SERVE_JOB_BATCHES=$j Q6SERVE_PIPELINE_SHORT=$p timeout 60 \
    python3 bench/frontend_cpu.py --backend "$B" --rows "$ROWS" --k "$K" --n 64 --hosts 8 \
    --seconds "$S" --warmup 0.5 --json "$OUT/fe_$tag.json" "$@" >"$OUT/fe_$tag.log" 2>&1
  note "# $tag rc=$? at $(elapsed): $(grep -h "^frontends=" "$OUT/fe_$tag.log" | cut -c1-260)"
}
svc() {  # $1 tag, $2 tree, $3 JOB, $4 front ends, $5 targets, $6 regions, rest: more
  local tag=$1 tree=$2 j=$3 f=$4 t=$5 r=$6
  shift 6
  PYTHONPATH=$(pp "$tree") Q6SERVE_JOB_BATCHES=$j timeout 90 python3 bench/service.py \
    --backend "$B" --row-scale "$SCALE" --dataplane --targets "$t" --regions "$r" "$@" \
    --modes stream --frontends "$f" --t3-hosts 8 --seconds "$S" --warmup 0.3 \
    --json "$OUT/dp_$tag.json" >"$OUT/dp_$tag.log" 2>&1
  note "# $tag rc=$? at $(elapsed)"
  mv "$OUT/worker.log" "$OUT/worker_$tag.log" 2>/dev/null
}
# 1. the lane, 8 hosts x 1 call
fe_cpu lane_j1 new 1 0 --lane --frontends 1 --callers 1
fe_cpu lane_j1_pipe new 1 1 --lane --frontends 1 --callers 1
fe_cpu lane_j4 new 4 0 --lane --frontends 1 --callers 1
fe_cpu lane_j8 new 8 0 --lane --frontends 1 --callers 1
fe_cpu lane_j4_pipe new 4 1 --lane --frontends 1 --callers 1
save
# 2. T3 through 4 front ends, system and CUDA regions
svc t3_j1_f4 new 1 4 T3 system --cuda-regions
svc t3_j4_f4 new 4 4 T3 system --cuda-regions
save
# 3. the base tree
if [[ -n ${OLD:-} ]]; then
  fe_cpu lane_old old 1 0 --lane --frontends 1 --callers 1
  fe_cpu lane_old_pipe old 1 1 --lane --frontends 1 --callers 1
  svc t3_old_f4 old 1 4 T3 system --cuda-regions
  save
fi
# 4. two calls in flight per host (extra rows; the 1-in-flight figures above are T3's)
fe_cpu lane2_j1_pipe new 1 1 --lane --frontends 1 --callers 2
fe_cpu lane2_j$J new "$J" 0 --lane --frontends 1 --callers 2
fe_cpu reg2_j1 new 1 0 --region system --frontends 4 --callers 2
fe_cpu reg2_j$J new "$J" 0 --region system --frontends 4 --callers 2
save
# 5. the GPU tests of the data plane
if [[ -z ${SKIP_TESTS:-} ]]; then
  timeout "${TESTS_TIMEOUT:-60}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/dataplane >"$OUT/pytest_dataplane_gpu.log" 2>&1
  note "# gpu tests rc=$? ($(tail -1 "$OUT/pytest_dataplane_gpu.log")) at $(elapsed)"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest_dataplane_gpu.log" | head -8 | cut -c1-240
fi
save
# 6. T3 regions at 1 and 8 front ends
for F in 1 8; do
  svc "t3_j1_f$F" new 1 "$F" T3 system --cuda-regions
  svc "t3_j${J}_f$F" new "$J" "$F" T3 system --cuda-regions
done
save
# 7. T2 through 4 front ends (bytes)
svc t2_j1_f4 new 1 4 T2 bytes
svc "t2_j${J}_f4" new "$J" 4 T2 bytes
save
python3 bench/dataplane_table.py "$OUT"
grep -h "^# lane\|^# reg" "$FINAL/progress.txt" | sed 's/CPU per call: //' | cut -c1-230
echo "# done at $(elapsed)"
