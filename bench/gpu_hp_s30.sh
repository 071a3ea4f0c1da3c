#!/usr/bin/env bash
# Session 30, helper hp (issue 14): kernels/cuda/launch.py split into launcher.py, plans.py,
# sequence.py, copies.py, workspace.py, bound_call.py, region_call.py, many.py and driver.py
# (session 30 had no GPU: the split was checked on the CPU with the fake device only). This
# script proves it on the H200 in one short call.
# PHASE=a (bound ~240 s): does the split run and cost nothing on the device?
# 1. wall: bench/backend_wall.py on the two 48 MB weights (4096x14336, 14336x4096), N=1 and 64,
#    graph and staged - the closing check's command - printed beside session 29's closing check
#    (H200, bench/results/2026-12-04_s29_closing_check_h200_4136299.tgz) per row: wall, kernel,
#    host = wall - kernel, y equal to the reference; again at the end (wall2) to bracket the
#    machine's drift across the call;
# 2. launch: the launch path's own tests on CuPy and the device: tests/service/test_launch_split.py
#    (-m gpu: the copy kernel's and the timing anchor's y against the copy engine's, bit for bit),
#    the host tests with real CuPy (tests/kernels/test_cuda_backend_host.py: its CuPy-only
#    cases skip on the CPU), tests/kernels/test_launch_*.py, test_pdl_launch.py,
#    test_cuda_inflight.py (launch slots), tests/dataplane/test_region_call.py;
# 3. regions: the pinned-region calls on the device (RegionCall, region_call.py):
#    tests/dataplane/test_pinned_gpu.py, test_device_direct_gpu.py;
# 4. kernels: the GPU suite tests/kernels (-m gpu; the closing check's: ~100 s), while the
#    bound allows (the dispatch table's calls through every tile, y against NumPy).
# PHASE=b (bound ~200 s): the rest of the GPU net downstream of the launch path, and the
# service's figures against session 29's closing check: `q6serve demo` on the GPU; the service
# suites on CuPy (the closing check's service_cuda list); T1 (bench/service.py --target-report
# T1: p50 - kernel, the reply's kernel time); the decode replay S=8, 1 (multi-weight calls,
# top-64 on the lm-head).
# BACKEND=numpy rehearses the commands' shapes on a CPU (DRY_RUN=1: tests/bench/test_gpu_scripts.py).
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-a}
gpu_session /tmp/hp
BACKEND=${BACKEND:-cuda}

# session 29's closing check, backend_wall.py on the H200 (shape n mode: wall kernel host, us)
S29_WALL="4096x14336 1 graph 38.7 19.2 19.5
4096x14336 1 staged 36.8 19.2 17.6
4096x14336 64 graph 246.0 34.4 211.8
4096x14336 64 staged 120.0 34.3 85.6
14336x4096 1 graph 44.0 19.5 24.3
14336x4096 1 staged 43.1 19.4 23.8
14336x4096 64 graph 170.6 46.2 124.4
14336x4096 64 staged 137.3 46.2 91.1"

wall() {  # wall NAME: the closing check's backend_wall.py command, its JSON in $OUT/NAME.json
  step_if 12 "$1" 45 python3 bench/backend_wall.py --shapes 4096x14336,14336x4096 --ns 1,64 \
    --modes graph,staged --json "$OUT/$1.json"
}
wall_vs_s29() {  # wall_vs_s29 NAME...: each run's rows beside session 29's (host = wall - kernel)
  OUT=$OUT S29_WALL=$S29_WALL python3 - "$@" <<'PY'
import json, os, sys
ref = {tuple(f[:3]): tuple(map(float, f[3:])) for f in
       (line.split() for line in os.environ["S29_WALL"].splitlines())}
print("# backend_wall p50 us: wall / kernel / host (= wall - kernel), this run vs session 29")
for name in sys.argv[1:]:
    path = os.path.join(os.environ["OUT"], name + ".json")
    if not os.path.exists(path):
        print(f"{name}: no {name}.json")
        continue
    for r in json.load(open(path))["results"]:
        key = (r["shape"], str(r["n"]), r["mode"])
        w, k, h = r["wall_p50"], r["kernel_p50"], r["host_p50"]
        old = ref.get(key)
        was = (f"s29 {old[0]:6.1f} / {old[1]:5.1f} / {old[2]:6.1f}  host {h - old[2]:+6.1f}"
               if old else "s29 -")
        print(f"{name:5} {' '.join(key):22} {w:6.1f} / {k:5.1f} / {h:6.1f}  {was}  "
              f"y {'equal' if r['equal'] else 'DIFFERS' if r['equal'] is False else '-'}")
PY
}

if [[ $PHASE == a ]]; then
  BOUND=${BOUND:-240}
  wall wall
  step_if 10 launch 60 python3 -m pytest -q -rfE -p no:cacheprovider \
    tests/service/test_launch_split.py tests/kernels/test_cuda_backend_host.py \
    tests/kernels/test_launch_modules.py tests/kernels/test_launch_y16.py \
    tests/kernels/test_launch_ieee.py tests/kernels/test_pdl_launch.py \
    tests/kernels/test_cuda_inflight.py tests/dataplane/test_region_call.py
  step_if 10 regions 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/dataplane/test_pinned_gpu.py tests/dataplane/test_device_direct_gpu.py
  RESERVE=14 step_if 30 kernels 180 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/kernels
  wall wall2
  {
    echo "# hp s30 PHASE=a (the launch path split), tree $(tree_commit), $(elapsed)"
    wall_vs_s29 wall wall2
    grep -hE "passed|failed|error" "$OUT"/{launch,regions,kernels}.log 2>/dev/null \
      | tail -6 | cut -c1-200
    machine_summary
    steps
  } | table
elif [[ $PHASE == b ]]; then
  BOUND=${BOUND:-200}
  step_if 10 demo 60 python3 -m q6serve.client.cli demo --backend "$BACKEND"
  Q6SERVE_TEST_BACKEND=$BACKEND step_if 20 service 90 python3 -m pytest -q -rfE \
    -p no:cacheprovider tests/service/test_multi_topk.py tests/service/test_rpcs.py \
    tests/service/test_vram.py tests/reliability/test_slow_reader.py \
    tests/reliability/test_batch_isolation.py \
    tests/reliability/test_refused_requests.py tests/reliability/test_upload_buffers.py
  step_if 20 t1 60 python3 bench/service.py --backend "$BACKEND" --target-report --targets T1 \
    --modes stream --weights ffn_down --seconds 2 --warmup 0.3 --json "$OUT/t1.json"
  RESERVE=2 step_if 40 replay 120 python3 bench/service.py --backend "$BACKEND" --replay \
    --replay-seqs "${SEQS:-8,1}" --seconds 2 --warmup 0.5 --json "$OUT/replay.json"
  {
    echo "# hp s30 PHASE=b (downstream of the split), tree $(tree_commit), $(elapsed)"
    echo "# session 29's closing check: T1 p50 - kernel 235 (first) / 174 (again) us;" \
      "replay S=8 multi step p50 85.92 ms, S=1 multi 74.34 ms"
    grep -hE "passed|failed|error|results match" "$OUT"/{demo,service}.log 2>/dev/null \
      | tail -4 | cut -c1-200
    grep -hE "^# T1|mean us" "$OUT/t1.log" 2>/dev/null | cut -c1-300
    grep -hE "^# replay S=" "$OUT/replay.log" 2>/dev/null | cut -c1-250
    machine_summary
    steps
  } | table
fi
exit 0
