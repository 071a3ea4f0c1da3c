#!/usr/bin/env bash
# Session 9, helper hp (issue 14, the backend's host path), one device call: the GPU tests of the
# host path (tests/kernels/test_cuda_backend.py, test_cuda_inflight.py; the service's RPC and
# upload-buffer tests on the CUDA backend), then bench/backend_wall.py on the 48 MB weights
# (4096x14336, 14336x4096) at N=1,16,32,64, modes graph and staged, --floor, with the base tree
# (BASE: a copy of main) and this tree alternated twice on the same machine, and (sy0, N=1 only)
# this tree with --small-y-f32 0 (an f32 y never copied out after the sync). The table last
# (host = wall - kernel, p50 us; base runs / this tree's runs); logs in $FINAL/hp_s9.tgz.
#   bench/gpu_hp_s9.sh [BASE]   (default ./base)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp
base_tree "${1:-base}"
pack() { tar czf "$FINAL/hp_s9.tgz" -C "$OUT" . 2>/dev/null; }
timeout 90 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_cuda_backend.py \
  tests/kernels/test_cuda_inflight.py >"$OUT/tests_kernels.log" 2>&1
note "tests_kernels rc=$? $(tail -1 "$OUT/tests_kernels.log") at $(elapsed)"
Q6SERVE_TEST_BACKEND=cuda timeout 45 python3 -m pytest -q -rfE -p no:cacheprovider \
  tests/service/test_rpcs.py tests/reliability/test_upload_buffers.py >"$OUT/tests_service.log" 2>&1
note "tests_service rc=$? $(tail -1 "$OUT/tests_service.log") at $(elapsed)"
pack
for round in 1 2; do
  for v in base new sy0; do
    pp=$NOWPP ns=1,16,32,64 extra=()
    [[ $v == base ]] && pp=$BASEPP
    # sy0: this tree with every f32 y DMA'd into a pinned block that becomes the result (N=1)
    [[ $v == sy0 ]] && ns=1 extra=(--small-y-f32 0)
    PYTHONPATH=$pp timeout 75 python3 bench/backend_wall.py --shapes 4096x14336,14336x4096 \
      --ns $ns --modes graph,staged --floor --calls 200 "${extra[@]}" \
      --json "$OUT/wall_${v}_$round.json" >"$OUT/wall_${v}_$round.log" 2>&1
    note "wall $v $round rc=$? at $(elapsed)"
    pack
  done
done
python3 - "$OUT" <<'PY' | tee "$OUT/table.txt" "$FINAL/table.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {}
for f in sorted(out.glob("wall_*_*.json")):
    _, v, r = f.stem.split("_")
    for row in json.loads(f.read_text())["results"]:
        runs.setdefault((row["shape"], row["n"], row["mode"]), {}).setdefault(v, []).append(row)
print("shape       N  mode    | host p50 base / new (wall p50 base / new; kernel) | floor h2d d2h")
for (shape, n, mode), by in runs.items():
    if mode == "floor":
        continue
    fl = runs.get((shape, n, "floor"), {}).get("new", [{}])[0]
    def f(v, key):
        return "/".join(f"{r[key]:.1f}" for r in by.get(v, []))
    sy = f" sy0 {f('sy0', 'host_p50')}" if "sy0" in by else ""
    print(f"{shape:>10} {n:>2} {mode:>7} | {f('base', 'host_p50')} -> {f('new', 'host_p50')}{sy} "
          f"(wall {f('base', 'wall_p50')} -> {f('new', 'wall_p50')}; kernel {f('new', 'kernel_p50')})"
          f" | {fl.get('h2d', float('nan')):.1f} {fl.get('d2h', float('nan')):.1f}")
PY
pack
echo "done at $(elapsed)"
