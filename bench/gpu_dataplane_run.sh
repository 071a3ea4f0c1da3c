#!/usr/bin/env bash
# One GPU session for the data plane (issue 15): the GPU tests of tests/dataplane (CUDA IPC
# regions, one process and --frontends 2), then bench/service.py --dataplane (T2: 64 callers
# of N=1 on ffn_down, rows/s and p99; T3: 8 hosts of N=64, rows/s against the kernel alone;
# each with bytes in the messages and with shared-memory regions; T3 also with CUDA IPC device
# buffers) for --frontends 1, 2, 4, 8; then bench/device_path.py (the device thread's cost per
# batch in-process, T2's and T3's shapes), bench/lane_latency.py (one caller: gRPC vs the
# fast lane) and bench/device_ipc.py (the device process alone: CPU per front-end message).
# A short table is printed last; $OUT gets one archive of every log and JSON and the test
# log. About 50 s + 17 s per variant with the default SECONDS_PER_RUN=1.5 (H200, 2026-12-01).
#   bench/gpu_dataplane_run.sh   env: SECONDS_PER_RUN, VARIANTS ("1 2 4 8"; "8@200": --frontends 8
#                                with a 200 us GIL switch interval; "8:0": with
#                                Q6SERVE_FRONTEND_STACKS=0; "8:m0": with Q6SERVE_DEVICE_MERGE=0;
#                                "6rr": with Q6SERVE_FRONTEND_ROUND_ROBIN=1; unset: the
#                                default; the device pipeline's switch is gone (dp, session
#                                17: CUDA-region calls are always pipelined)),
#                                SKIP_TESTS, SKIP_PROBES, BENCH_FIX (1: see below)
# BENCH_FIX=1 (default): bench/service.py's Bench.one passed region/own_channel positionally
# into run()'s topk/region, so every --dataplane run used shm regions and a connection per
# load process (bench/RESULTS.md, issue 15 session 5); until that is fixed in the file, a
# shipped copy (one with the sender's COMMIT file: never a checkout) is fixed with sed (a
# no-op once the file is fixed).
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dataplane_run
S=${SECONDS_PER_RUN:-1.5}
if [[ ${BENCH_FIX:-1} == 1 && -f COMMIT ]]; then
  sed -i 's/got = self.run(label, \[weight\], hosts, callers, n, mode, region, own_channel)/got = self.run(label, [weight], hosts, callers, n, mode, region=region,\n                       own_channel=own_channel)/' bench/service.py
  echo "# bench/service.py one(): region/own_channel by keyword: $(grep -c 'own_channel=own_channel)' bench/service.py)"
fi
if [[ -z ${SKIP_TESTS:-} ]]; then
  timeout 120 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/dataplane \
    >"$OUT/pytest_dataplane_gpu.log" 2>&1
  echo "# gpu tests rc=$? ($(tail -1 "$OUT/pytest_dataplane_gpu.log")) at $(elapsed)"
fi
# VARIANTS: front-end counts and switches (gpu_lib.sh's dp_variant); set and empty: none (the
# probes alone, as bench/gpu_check.sh runs them after its own variants)
for v in ${VARIANTS-1 2 4 8}; do
  dp_variant "$v"
  F=$DP_F
  tag=$DP_TAG
  # per-process CPU while T2 runs (which of load, front ends, device process is busy); a run
  # over before the sampler (one that failed to start) ends it
  (sleep 5; top -b -c -w 200 -d 1 -n 3 | grep -E "^top|python|q6serve" | head -120) \
    >"$OUT/top_$tag.log" 2>&1 &
  sampler=$!
  env "${DP_ENV[@]}" timeout 80 python3 bench/service.py \
    --backend cuda --dataplane \
    --modes stream --frontends "$F" --t3-hosts 8 --seconds "$S" --warmup 0.3 --cuda-regions \
    --json "$OUT/dataplane_$tag.json" >"$OUT/dataplane_$tag.log" 2>&1
  echo "# frontends=$F ${DP_ENV[*]} rc=$? at $(elapsed)"
  mv "$OUT/worker.log" "$OUT/worker_$tag.log" 2>/dev/null
  kill "$sampler" 2>/dev/null
  wait
done
# the device path without gRPC (T2's and T3's shapes in-process) and the fast lane's latency
if [[ -z ${SKIP_PROBES:-} ]]; then
  timeout 60 python3 bench/device_path.py --backend cuda --callers 64 --n 1 --seconds "$S" \
    --json "$OUT/device_path_t2.json" >"$OUT/device_path.log" 2>&1
  timeout 60 python3 bench/device_path.py --backend cuda --callers 8 --n 64 --seconds "$S" \
    --json "$OUT/device_path_t3.json" >>"$OUT/device_path.log" 2>&1
  timeout 90 python3 bench/lane_latency.py --backend cuda --rows 3584 --k 18944 --seconds "$S" \
    --json "$OUT/lane.json" >"$OUT/lane.log" 2>&1
  # the device process alone, fed front-end messages: CPU per message and per call (T2-like)
  timeout 60 python3 bench/device_ipc.py --backend cuda --rows 3584 --k 18944 --stack 4 \
    --inflight 16 --seconds "$S" --json "$OUT/device_ipc.json" >"$OUT/device_ipc.log" 2>&1
  echo "# probes rc=$? at $(elapsed)"
  cat "$OUT/device_path.log" "$OUT/lane.log" "$OUT/device_ipc.log" | grep -v "^#"
fi
grep -h "FAILED\|Traceback" "$OUT"/dataplane_f*.log | head -5
python3 - "$OUT" <<'EOF'
import glob, json, sys
rows = []
commit, device = "?", "no results (every run failed)"
for path in sorted(glob.glob(f"{sys.argv[1]}/dataplane_f*.json")):
    doc = json.load(open(path))
    tag = path.rsplit("dataplane_", 1)[1][:-5]  # f8, f8_gil200, f8_stacks0
    for t in doc["targets"]:
        rows.append((t["target"], tag, t["region"], t))
    commit, device = doc["commit"], doc["device"]
print(f"# {device}; commit {commit}")
print("# target variant   x/y via   rows/s      p99 us  kernel rows/s  fraction  met")
for target, fe, region, t in sorted(rows, key=lambda r: (r[0], r[2], r[1])):
    rps = t.get("rows_per_s", t.get("service_rows_per_s", 0.0))
    print(f"# {target:6} {fe:9}  {region:7} {rps:>10,.0f} {t['p99_us']:>10,.0f}"
          f" {t.get('kernel_rows_per_s', 0):>13,.0f} {t.get('fraction', 0):>9.2f}"
          f"  {'yes' if t['met'] else 'no'}")
EOF
archive && cp "$OUT/pytest_dataplane_gpu.log" "$FINAL/" 2>/dev/null
echo "# done at $(elapsed)"
