#!/usr/bin/env bash
# Session 18, issue 15, bundle B: T3 (8 hosts of N=64 on ffn_down, round robin) at this tree, whose
# "rm"/"rmok" device-socket messages now have fixed layouts (no pickling a region call), A/B'd
# with this tree's switches, alternated:
# - CUDA regions, 6 front ends: Q6SERVE_DP_LEAN=0 (session 17's launch of a CUDA-region call) / 1;
# - CUDA regions, lean: 6 / 8 front ends (8: one per host, none shared; bundle A's device process
#   spun ~1/5 of its loop waiting for messages, so the front ends' path is most of a call);
# - system regions, 6 front ends: Q6SERVE_DP_SYS_PIPE=0 (a full call queued to the batcher) / 1
#   (through the device process's pipeline by Engine.launch_now, repeats by their region plan).
# First `pytest -m gpu tests/dataplane`. No run starts past BOUND - NEED s; a table last.
#   bench/gpu_dataplane_s18b.sh   env: BOUND (95), NEED (8), BACKEND (cuda; numpy: a CPU
#                                 rehearsal with DRY_RUN=1, ROW_SCALE)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dp18b
BOUND=${BOUND:-95} BACKEND=${BACKEND:-cuda}
export Q6SERVE_FRONTEND_ROUND_ROBIN=1
if left 50; then
  timeout "$(bound 40 4)" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/dataplane \
    >"$OUT/pytest_dataplane_gpu.log" 2>&1
  note "# gpu tests rc=$? ($(tail -1 "$OUT/pytest_dataplane_gpu.log")) at $(elapsed)"
fi
t3() {  # t3 RUN NAME: bench/service.py's T3 over $REGION regions with $FRONTENDS front ends
  timeout "$(bound 30 4)" python3 bench/service.py --backend "$BACKEND" --dataplane \
    --modes stream --frontends "${FRONTENDS:-6}" --t3-hosts 8 \
    --seconds "${SECONDS_PER_RUN:-1.5}" --warmup 0.3 --targets T3 --regions "${REGION:-cuda}" \
    --row-scale "${ROW_SCALE:-1.0}" --json "$OUT/t3_$1.json" >"$OUT/t3_$1.log" 2>&1
  note "# $1 (T3 ${REGION:-cuda}, ${FRONTENDS:-6} front ends, lean ${Q6SERVE_DP_LEAN:-1}, sys pipe ${Q6SERVE_DP_SYS_PIPE:-1}) rc=$? at $(elapsed)"
  archive 2>/dev/null
}
C6=REGION=cuda C8=REGION=cuda,FRONTENDS=8 C0=REGION=cuda,Q6SERVE_DP_LEAN=0
S1=REGION=system S0=REGION=system,Q6SERVE_DP_SYS_PIPE=0
ab_runs "${NEED:-8}" t3 "c6:$C6" "c8:$C8" "soff:$S0" "son:$S1" "coff:$C0" "c8:$C8" "c6:$C6" \
  "son:$S1" "soff:$S0" "coff:$C0"
{
  python3 bench/t3_ab_table.py "$OUT" --pair coff:c6:"cuda, lean 0 / 1" --pair c6:c8:"cuda, 6 / 8 front ends" \
    --pair soff:son:"system, pipe 0 / 1"
} | table
