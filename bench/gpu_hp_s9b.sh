#!/usr/bin/env bash
# Session 9, helper hp (issue 14, the backend's host path), second device call: call 1
# (gpu_hp_s9.sh) showed process-to-process noise of 5-15 us on identical code, so this one
# compares the host path's variants *in one process*, alternated per (shape, N), 3 rounds, twice
# (two processes): off (x copied whole, uploaded by the graph: main's path), on (the pipelined
# upload of an unstaged x), t256 (the same with 256 KiB tail chunks), ext (a staged x uploaded
# before the graph, not by a node of it), sy0 (an f32 y always into a pinned block, no copy after
# the sync); with --probe (the host's clock around the graph launch and y's way out) and --floor;
# then the base tree (BASE, a copy of main) once with --probe. First the GPU tests of the paths.
# Ran once at 6e9394a (bench/RESULTS.md, "Host path (issue 14), session 9"); the variants' constants
# (UPLOAD_PIPE_MIN, UPLOAD_TAIL, STAGED_UPLOAD_OUTSIDE) were dropped after it: not faster.
#   bench/gpu_hp_s9b.sh [BASE]   (default ./base)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hpb
base_tree "${1:-base}"
pack() { tar czf "$FINAL/hp_s9b.tgz" -C "$OUT" . 2>/dev/null; }
timeout 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_cuda_backend.py \
  -k "upload or staging or graphs_and_direct or returned_arrays or half_outputs or in_flight or slots" \
  tests/kernels/test_cuda_inflight.py >"$OUT/tests_kernels.log" 2>&1
note "tests_kernels rc=$? $(tail -1 "$OUT/tests_kernels.log") at $(elapsed)"
pack
VARIANTS="off:UPLOAD_PIPE_MIN=1e12;on;t256:UPLOAD_TAIL=262144;ext:STAGED_UPLOAD_OUTSIDE=262144;sy0:SMALL_Y_F32=0"
ARGS=(--shapes 4096x14336,14336x4096 --ns 1,16,32,64 --modes graph,staged --floor --probe --calls 150)
for p in 1 2; do
  PYTHONPATH=$NOWPP timeout 80 python3 bench/backend_wall.py "${ARGS[@]}" --rounds 3 \
    --variants "$VARIANTS" --json "$OUT/wall_var_$p.json" >"$OUT/wall_var_$p.log" 2>&1
  note "wall variants $p rc=$? at $(elapsed)"
  pack
done
PYTHONPATH=$BASEPP timeout 40 python3 bench/backend_wall.py "${ARGS[@]}" \
  --json "$OUT/wall_base.json" >"$OUT/wall_base.log" 2>&1
note "wall base rc=$? at $(elapsed)"
{
  for p in 1 2; do
    echo "## process $p: variants (host p50 = wall - kernel, median of 3 rounds; (wall p50))"
    sed -n '/^# variants/,$p' "$OUT/wall_var_$p.log" | tail -n +2
  done
  echo "## probe, process 1 round 1 (staged): pre = launch call until the graph launch"
  grep " staged " "$OUT/wall_var_1.log" | grep -E " (off|on|ext)$" | head -24 | cut -c1-200
  echo "## base tree (one process)"
  grep -v "^#" "$OUT/wall_base.log" | cut -c1-200
} | tee "$OUT/table.txt" "$FINAL/table.txt"
pack
echo "done at $(elapsed)"
