#!/usr/bin/env bash
# The closing GPU check of a session (one device call, ~5 min): the GPU test suites of the
# kernels and the data plane, the service and issue-18 tests on the CUDA backend, `q6serve demo`
# on CUDA, issue 14's targets (T1, the lm-head top-k in one process (busy polling on and off) and through 4 front ends, the 7B decode replay at S = 1, 8, 64 with
# and without multi-weight calls), T1 and the S=8 replay again with the worker pinned (PIN,
# bench/service.py --pin), the loop-trip timeline of a T1 round trip (stream_overhead --trips),
# the data plane at 4 and 8 front ends (DP_VARIANTS) with its device-path and fast-lane probes,
# and at 4 front ends pinned
# (bench/gpu_dataplane_run.sh). Prints a short table last, ending with every target's figure,
# limit and verdict (bench/check_targets.py; the kernel reference: bench/kernels.py on the
# targets' shapes, kernel_ref); $OUT gets the
# logs (8 files at most come back: an archive + the table).
#   bench/gpu_check.sh   env: SKIP_DATAPLANE=1, SKIP_REPLAY=1, SKIP_PINNED=1 (no pinned runs),
#   SKIP_TRIPS=1, REPLAY_SECONDS (2), REPLAY_SEQS (1,8,64), REPLAY_SPINS (0: the replay host's
#   loop busy-polling, bench/service.py --replay-spins), REPLAY_STAMPS=1 (the worker's replies
#   stamped: the replay's way up and down per call), TESTS_ONLY=1 (the test suites, the demo and T1; nothing else;
#   KERNELS_LAST=SECONDS runs the kernels' suite last, within that limit, so a short device
#   budget spends itself on the rest first (with or without TESTS_ONLY); KERNELS_LAST=0 leaves it out, for a call that runs the
#   kernels' tests itself; WALL=1 adds the host wall of CudaBackend.matmul at N = 1, 64), SKIP_PROBES=1 (the data plane's probes), LANE=1 (the
#   fast lane at T3's shape, bench/gpu_dataplane_lane.sh, and one caller's latency,
#   bench/lane_latency.py),
#   DP_VARIANTS (the data plane's front-end counts, "4 8"; "8:m0" = 8 with the device-side
#   merge off), PIN ("2:8-15")
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/check
kernels() { step kernels_gpu "${1:-220}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/kernels; }
[[ -z ${KERNELS_LAST:-} ]] && kernels
step dataplane_gpu 90 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/dataplane
Q6SERVE_TEST_BACKEND=cuda step service_cuda 150 python3 -m pytest -q -rfE -p no:cacheprovider \
  tests/service/test_multi_topk.py tests/service/test_rpcs.py tests/service/test_vram.py \
  tests/reliability/test_slow_reader.py tests/reliability/test_batch_isolation.py \
  tests/reliability/test_refused_requests.py tests/reliability/test_upload_buffers.py
# the captured launch sequences' GPU tests: the copy kernel's and the timing anchor's y against
# the copy engine's, bit for bit (both defaults since sessions 17-18)
step launch_gpu 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  tests/service/test_launch_split.py
step demo 150 python3 -m q6serve.client.cli demo --backend cuda
if [[ -n ${TESTS_ONLY:-} ]]; then  # a first check of a session's main: the suites, the demo, T1
  step t1 90 python3 bench/service.py --backend cuda --target-report --targets T1 --modes stream \
    --weights ffn_down --seconds 2 --warmup 0.3 --json "$OUT/t1.json"
  [[ -n ${WALL:-} ]] && step wall 90 python3 bench/backend_wall.py --shapes 4096x14336,14336x4096 \
    --ns 1,64 --modes graph,staged --json "$OUT/wall.json"
  [[ -n ${KERNELS_LAST:-} && $KERNELS_LAST != 0 ]] && kernels "$KERNELS_LAST"
  { echo "# gpu_check TESTS_ONLY $(tree_commit) total $(elapsed)"; steps
    grep -E "^# T1|mean us|bare gRPC" "$OUT/t1.log" | tail -5 | cut -c1-400; } | table
  exit 0
fi
# issue 14: CudaBackend.matmul wall vs kernel on the 48 MB weights (no gRPC)
step wall 90 python3 bench/backend_wall.py --shapes 4096x14336,14336x4096 --ns 1,64 \
  --modes graph,staged --json "$OUT/wall.json"
# the kernel the targets hold the host wall and the reply's kernel time to (check_targets.py)
step kernel_ref 60 python3 bench/kernels.py --paths auto --dtypes f16 --ns 1,64 --no-torch \
  --shapes 3584x18944,4096x14336,14336x4096 --json "$OUT/kernels_ref.json"
step lm_head 90 python3 bench/service.py --backend cuda --lm-head --mode stream --seconds 2 \
  --warmup 0.3 --json "$OUT/lm_head.json"
# the same through 4 front-end processes (the 458 KB requests read and decoded beside the loop)
# one process with the loop's busy polling off (session 8 turned it on by default on 8+ cores)
Q6SERVE_BUSY_POLL_US=0 step lm_head_nospin 90 python3 bench/service.py --backend cuda --lm-head \
  --mode stream --seconds 2 --warmup 0.3 --json "$OUT/lm_head_nospin.json"
step lm_head_fe4 90 python3 bench/service.py --backend cuda --lm-head --mode stream --seconds 2 \
  --warmup 0.3 --frontends 4 --json "$OUT/lm_head_fe4.json"
step t1 90 python3 bench/service.py --backend cuda --target-report --targets T1 --modes stream \
  --weights ffn_down --seconds 2 --warmup 0.3 --json "$OUT/t1.json"
PIN=${PIN:-2:8-15}  # the worker (and the bare gRPC floor) on core 2, the load on 8-15
[[ -z ${SKIP_PINNED:-} ]] && step t1_pinned 90 python3 bench/service.py --backend cuda --target-report --targets T1 \
  --modes stream --weights ffn_down --seconds 2 --warmup 0.3 --pin "$PIN" \
  --json "$OUT/t1_pinned.json"
[[ -z ${SKIP_TRIPS:-} ]] && step trips 60 python3 bench/stream_overhead.py --backend cuda --variants bare,worker --trips \
  --timeline 12 --rounds 1 --seconds 1.5 --inproc 0
if [[ -z ${SKIP_REPLAY:-} ]]; then
  # REPLAY_STAMPS=1: the worker's replies stamped (bench/reply_stamps.py through
  # bench/trips_site: each call's transport split into its way up and down); REPLAY_SPINS:
  # the host's loop busy-polls (bench/service.py --replay-spins, e.g. "0,1000")
  stamps=()
  [[ -n ${REPLAY_STAMPS:-} ]] && stamps=(env "PYTHONPATH=$PWD/bench/trips_site${PYTHONPATH:+:$PYTHONPATH}"
    Q6SERVE_REPLY_STAMPS=1)
  step replay 200 "${stamps[@]}" python3 bench/service.py --backend cuda --replay \
    --replay-seqs "${REPLAY_SEQS:-1,8,64}" --replay-spins "${REPLAY_SPINS:-0}" \
    --seconds "${REPLAY_SECONDS:-2}" --warmup 0.5 --json "$OUT/replay.json"
  [[ -z ${SKIP_PINNED:-} ]] && step replay_pinned 100 python3 bench/service.py --backend cuda --replay --replay-seqs 8 \
    --multi on --seconds 2 --warmup 0.5 --pin "$PIN" --json "$OUT/replay_pinned.json"
fi
if [[ -z ${SKIP_DATAPLANE:-} ]]; then
  # T2/T3 with --frontends 4 pinned: the device process on core 2, a front end on each of 3-6
  [[ -z ${SKIP_PINNED:-} ]] && step dataplane_pinned 150 python3 bench/service.py --backend cuda --dataplane --modes stream \
    --frontends 4 --t3-hosts 8 --seconds 2 --warmup 0.5 --pin 2-6:7-15 \
    --json "$OUT/dataplane_pinned.json"
  # (not VARIANTS: gpu_dataplane_lane.sh reads that one with another meaning)
  VARIANTS=${DP_VARIANTS:-4 8} SKIP_TESTS=1 OUT="$OUT/dataplane" timeout 240 \
    bench/gpu_dataplane_run.sh >"$OUT/dataplane.log" 2>&1
  echo "# dataplane rc=$? at $(elapsed)"
  # its T2/T3 JSONs beside the others for the targets' table (they travel in its archive)
  tar -xzf "$OUT/dataplane/dataplane_run.tgz" -C "$OUT/dataplane" --wildcards \
    "./dataplane_f*.json" 2>/dev/null
fi
if [[ -n ${LANE:-} ]]; then  # T3's shape through the fast lane (1 and 2 calls in flight a host)
  env -u VARIANTS SKIP_TESTS=1 SECONDS_PER_RUN=2 OUT="$OUT/lane" timeout 90 bench/gpu_dataplane_lane.sh \
    >"$OUT/lane.log" 2>&1
  echo "# lane rc=$? at $(elapsed)"
  # the stretch target: one caller N=1 ffn_down on the lane, p50 - kernel (y checked)
  step lane_latency 60 python3 bench/lane_latency.py --backend cuda --rows 3584 --k 18944 \
    --paths grpc,lane --check --seconds 2 --warmup 0.3 --json "$OUT/lane_latency.json"
fi
[[ -n ${KERNELS_LAST:-} && $KERNELS_LAST != 0 ]] && kernels "$KERNELS_LAST"
{
  echo "# gpu_check $(tree_commit) total $(elapsed)"
  steps
  grep -E "lm-head|reply|p50" "$OUT/lm_head.log" | tail -3
  echo "## lm-head, busy polling off"
  grep -E "lm-head|reply|p50" "$OUT/lm_head_nospin.log" | tail -3
  echo "## lm-head --frontends 4"
  grep -E "lm-head|reply|p50" "$OUT/lm_head_fe4.log" | tail -3
  grep -v "^\s*$" "$OUT/wall.log" | tail -8
  grep -E "^# T1|mean us|bare gRPC|\"target\": \"T1\"" "$OUT/t1.log" | tail -5 | cut -c1-400
  echo "## pinned ($PIN)"
  grep -E "^# T1|mean us" "$OUT/t1_pinned.log" 2>/dev/null | tail -3
  grep -E "median|loop trips" "$OUT/trips.log" 2>/dev/null | cut -c1-160
  grep -E "^# replay|per step" "$OUT/replay.log" 2>/dev/null | tail -12
  grep -E "^    per call" "$OUT/replay.log" 2>/dev/null | head -6 | cut -c1-200
  echo "## replay pinned ($PIN)"
  grep -E "^# replay|per step" "$OUT/replay_pinned.log" 2>/dev/null | tail -4
  grep "^# " "$OUT/dataplane.log" 2>/dev/null | tail -14
  echo "## dataplane --frontends 4 pinned (2-6:7-15)"
  grep -E "^T2|^T3|^# T2|^# T3" "$OUT/dataplane_pinned.log" 2>/dev/null | tail -8
  grep "^# lane_" "$OUT/lane.log" 2>/dev/null | cut -c1-220
  grep -E "^lane|^grpc|check:" "$OUT/lane_latency.log" 2>/dev/null | tail -4 | cut -c1-200
  # one row per issue 14 / 15 target: figure, limit, met / missed (for bench/RESULTS.md)
  python3 bench/check_targets.py "$OUT"
} | table
# each step's status is in the table; the greps above of skipped steps' logs must not set the exit status
exit 0
