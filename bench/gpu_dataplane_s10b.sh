#!/usr/bin/env bash
# Issue 15, session 10, second GPU call (helper dp): what bounds T3 through the fast lane now that
# its full batches are pipelined (8 hosts x 4 callers of N=64 on ffn_down, page-locked regions).
# The device loop busy-polls and lane callers spin by default on >= 8 cores, so "1.00 core" says
# nothing of saturation: one run as usual, one with both off (Q6SERVE_BUSY_POLL_US=0,
# Q6SERVE_LANE_SPIN_US=0: the cores then are work and CUDA's spinning syncs), one under
# `py-spy record --native` (frames with the most samples: Python, the CUDA host path, the
# event syncs, epoll) with nvidia-smi mid-load. Each step archived into $FINAL as it ends.
#   bench/gpu_dataplane_s10b.sh   env: SECONDS_PER_RUN (2)
#   DRY_RUN=1 BACKEND=numpy ROWS=64 K=512 OUT=/tmp/o bench/gpu_dataplane_s10b.sh   (CPU)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps10b
S=${SECONDS_PER_RUN:-2}
BACKEND=${BACKEND:-cuda} ROWS=${ROWS:-3584} K=${K:-18944}
archive() { tar czf "$FINAL/dataplane_s10b.tgz" -C "$OUT" .; }
LANE=(--backend "$BACKEND" --rows "$ROWS" --k "$K" --n 64 --lane --frontends 1 --hosts 8
      --callers 4 --warmup 0.5)
lane() {  # lane TAG [ENV...]
  local tag=$1
  shift
  env "$@" timeout 40 python3 bench/frontend_cpu.py "${LANE[@]}" --seconds "$S" \
    --json "$OUT/lane_$tag.json" >"$OUT/lane_$tag.log" 2>&1
  note "# lane $tag rc=$? at $(elapsed): $(grep -h "^frontends=\|^#   cpu" "$OUT/lane_$tag.log" \
    | cut -c1-230 | tr '\n' ' ')"
  archive
}
lane new
lane nopoll Q6SERVE_BUSY_POLL_US=0 Q6SERVE_LANE_SPIN_US=0
SPY=/tmp/site/bin/py-spy
[[ -x $SPY ]] || SPY=$(command -v py-spy || true)
if [[ -n $SPY ]]; then
  PYSPY=$SPY PYSPY_ARGS="--native -r 200" timeout 60 python3 bench/frontend_cpu.py "${LANE[@]}" \
    --seconds 3 --profile "$OUT/prof" --json "$OUT/prof/result.json" >"$OUT/prof.log" 2>&1
  note "# profile rc=$? at $(elapsed): $(grep -h "^frontends=" "$OUT/prof.log" | cut -c1-200)"
  [[ -f $OUT/prof/pyspy.txt ]] && timeout 30 python3 bench/spy_summary.py "$OUT/prof/pyspy.txt" \
    --top 45 >"$OUT/prof/summary.txt" 2>&1
  archive
  head -100 "$OUT/prof/summary.txt" 2>/dev/null | cut -c1-150
  grep -A3 "GPU-Util\|MiB /" "$OUT/prof/nvidia_smi.txt" 2>/dev/null | head -6
  grep -E "q6serve|python" "$OUT/prof/top_threads.txt" 2>/dev/null | head -12 | cut -c1-120
else
  note "# no py-spy"
fi
archive
echo "# done at $(elapsed)"
