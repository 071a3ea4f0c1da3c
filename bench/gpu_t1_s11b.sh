#!/usr/bin/env bash
# Issue 14 T1, session 11, call 2: the H200 bisection of the echo rung that carries T1's transport
# excess (bench/gpu_t1_s11.sh found bare+icpt+proto+coro's up + down 110 us above the echo's
# whole round trip with a 12 us window): bench/stream_overhead.py's rungs one at a time at T1's
# sizes, with every server's loop trips counted and a timeline of its callbacks (which loop
# callback grows, by how many us of the loop thread's CPU), the rung with the worker's busy polling
# (does a spinning loop take the excess away?), the servicer over a stub engine (direct), the
# worker in process over a no-op backend (engine) and the CUDA worker beside. Bench only.
#   bench/gpu_t1_s11b.sh       env: ROUNDS (2)
#   a CPU rehearsal: DRY_RUN=1 BACKEND=numpy bench/gpu_t1_s11b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1s11b
(cd bench && timeout 80 python3 stream_overhead.py --backend "${BACKEND:-cuda}" --inproc 0 \
  --rows 3584 --out f32 --rounds "${ROUNDS:-2}" --seconds 0.5 --warmup 0.15 --trips --timeline 8 \
  --variants bare,bare+proto,bare+icpt,bare+coro,bare+icpt+coro,bare+icpt+proto+coro,bare+icpt+proto+coro+spin,direct,engine,worker) \
  >"$OUT/bisect.log" 2>&1
note "# bisect rc=$? ($(elapsed))"
cp "$OUT/bisect.log" "$FINAL/"
grep -vE "^\s+threads" "$OUT/bisect.log" | cut -c1-220
