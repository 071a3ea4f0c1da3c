#!/usr/bin/env bash
# Session 9, helper hp (issue 14, the backend's host path), round 2, one device call: the GPU
# tests of the host path (tests/kernels/test_cuda_backend.py, test_cuda_inflight.py, the bound
# top-k epilogue of test_epilogue.py, the service's RPC / upload-buffer / pinned-region tests on
# CUDA), then bench/backend_wall.py on the 48 MB weights at N=1,16,64 (graph, staged, --floor),
# each variant in its own process, alternated 3 times:
#   a = main (BASE: a copy of main; this tree's bench);   b = this tree (the cached BoundCall);
#   c = b with GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x40000 (a memcpy from
#       256 KiB up uses non-temporal stores: the fill of a large x does not evict the cache);
#   d = b with --fill concat (x written as the batcher does: np.concatenate of N one-row
#       arrays into the staging buffer);   e = d with the threshold at its minimum 0x4040
#       (a one-row copy of 28 KiB at K=14336 goes non-temporal too).
# Table last: host = wall - kernel (p50 per process, us), median over the 3 processes.
#   bench/gpu_hp_s9c.sh [BASE]   (default ./base)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hpc
base_tree "${1:-base}"
pack() { tar czf "$FINAL/hp_s9c.tgz" -C "$OUT" . 2>/dev/null; }
{ ldd --version | head -1; lscpu | grep -E "Model name|L2 cache|L3 cache"; } | tee "$OUT/host.txt"
timeout 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_cuda_backend.py \
  tests/kernels/test_cuda_inflight.py >"$OUT/tests_kernels.log" 2>&1
note "tests_kernels rc=$? $(tail -1 "$OUT/tests_kernels.log") at $(elapsed)"
timeout 30 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels/test_epilogue.py \
  -k "matches_reference and not split and not cupy_ops" >"$OUT/tests_epilogue.log" 2>&1
note "tests_epilogue rc=$? $(tail -1 "$OUT/tests_epilogue.log") at $(elapsed)"
Q6SERVE_TEST_BACKEND=cuda timeout 45 python3 -m pytest -q -rfE -p no:cacheprovider \
  tests/service/test_rpcs.py tests/reliability/test_upload_buffers.py \
  >"$OUT/tests_service.log" 2>&1
note "tests_service rc=$? $(tail -1 "$OUT/tests_service.log") at $(elapsed)"
timeout 40 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/dataplane/test_pinned_gpu.py \
  >"$OUT/tests_pinned.log" 2>&1
note "tests_pinned rc=$? $(tail -1 "$OUT/tests_pinned.log") at $(elapsed)"
pack
NT=glibc.cpu.x86_non_temporal_threshold
for round in 1 2 3; do
  for v in a b c d e; do
    pp=$NOWPP tun="" fill=copy
    case $v in
      a) pp=$BASEPP ;;
      c) tun=$NT=0x40000 ;;
      d) fill=concat ;;
      e) fill=concat tun=$NT=0x4040 ;;
    esac
    env ${tun:+GLIBC_TUNABLES=$tun} PYTHONPATH="$pp" timeout 25 python3 bench/backend_wall.py \
      --shapes 4096x14336,14336x4096 --ns 1,16,64 --modes graph,staged --floor --calls 120 \
      --fill $fill --json "$OUT/wall_${v}_$round.json" >"$OUT/wall_${v}_$round.log" 2>&1
    note "wall $v $round rc=$? at $(elapsed)"
  done
  pack
done
python3 - "$OUT" <<'PY' | tee "$OUT/table.txt" "$FINAL/table.txt"
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {}
for f in sorted(out.glob("wall_*_*.json")):
    _, v, r = f.stem.split("_")
    for row in json.loads(f.read_text())["results"]:
        runs.setdefault((row["shape"], row["n"], row["mode"]), {}).setdefault(v, []).append(row)
vs = "abcde"
print("host = wall - kernel, p50 us: median of the processes [each process]; staged: fill p50")
print("shape       N  mode   | " + " | ".join(vs))
for (shape, n, mode), by in runs.items():
    if mode == "floor":
        continue
    cells = []
    for v in vs:
        rs = by.get(v, [])
        if not rs:
            cells.append("-")
            continue
        h = [r["host_p50"] for r in rs]
        c = f"{statistics.median(h):.1f} [{'/'.join(f'{x:.0f}' for x in h)}]"
        if mode == "staged" and rs[0].get("fill_p50") is not None:
            c += f" f{statistics.median(r['fill_p50'] for r in rs):.0f}"
        cells.append(c)
    k = statistics.median(r["kernel_p50"] for rs in by.values() for r in rs)
    print(f"{shape:>10} {n:>2} {mode:>6} | " + " | ".join(cells) + f" | kernel {k:.1f}")
for (shape, n, mode), by in runs.items():
    if mode == "floor":
        fl = [r for rs in by.values() for r in rs]
        print(f"{shape:>10} {n:>2} floor: h2d {statistics.median(r['h2d'] for r in fl):.1f} "
              f"d2h {statistics.median(r['d2h'] for r in fl):.1f} "
              f"sync {statistics.median(r['sync'] for r in fl):.1f}")
PY
pack
echo "done at $(elapsed)"
