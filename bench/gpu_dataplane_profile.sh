#!/usr/bin/env bash
# One GPU session that profiles the device process of a --frontends worker under T2 (issue 15:
# 64 callers of N=1 on ffn_down's shape 3584x18944, 8 load processes x 8 callers, stream):
# bench/frontend_cpu.py --profile per variant = the device process's counters
# (Q6SERVE_DP_STATS: loop iterations, epoll time, reads, writes, batches, inline jobs' wall and
# CPU, per-thread CPU), top -H, top, nvidia-smi mid-load, and py-spy --native (the worker runs
# under `py-spy record`) for the variants marked +spy. A short table is printed last; $OUT gets
# one archive of every profile.
#   bench/gpu_dataplane_profile.sh   env: SECONDS_PER_RUN (6), VARIANTS ("4+spy 8+spy 8:i0 8:bs")
#     F[+spy][:i0][:bs][:TREE]: --frontends F; +spy: py-spy; :i0: --inline-device-us 0 (every
#     job on the device thread); :bs: CUDA blocking sync in the device process (a
#     sitecustomize sets cudaDeviceScheduleBlockingSync before CuPy makes its context: syncs
#     sleep instead of spinning); :t=DIR: run the tree in DIR (an A/B in one call)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dpprof
S=${SECONDS_PER_RUN:-6}
SPY=/tmp/site/bin/py-spy
echo "# ptrace_scope $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo none);" \
  "cpus $(nproc); $(lscpu | grep -E '^(Model name|Thread\(s\) per core)' | tr -s ' ' | tr '\n' ';')"
# py-spy must be able to ptrace its child (else the worker would never start under it)
if ! timeout 20 $SPY record -d 1 -o /tmp/spy_probe.txt -f raw -- python3 -c \
    "import time; time.sleep(1.5)" >/tmp/spy_probe.log 2>&1; then
  echo "# py-spy cannot profile here: $(tail -1 /tmp/spy_probe.log)"; SPY=""
fi
BS=/tmp/dp_bsync
mkdir -p $BS
cat >$BS/sitecustomize.py <<'EOF'
import os
import sys

if os.environ.get("Q6_BSYNC") == "1" and "worker" in sys.argv:  # the device process only
    import cupy

    cupy.cuda.runtime.setDeviceFlags(4)  # cudaDeviceScheduleBlockingSync
    print("sitecustomize: CUDA blocking sync, flags", cupy.cuda.runtime.getDeviceFlags(),
          file=sys.stderr)
EOF
ROOT=$PWD
for v in ${VARIANTS:-4+spy 8+spy 8:i0 8:bs}; do
  F=${v%%[+:]*}
  tag=f$(echo "$v" | tr '+:=/' '_-__')
  tree=$ROOT
  [[ $v =~ :t=([^:+]+) ]] && tree=$ROOT/${BASH_REMATCH[1]}
  args=()
  [[ $v == *:i0* ]] && args+=(--worker-arg=--inline-device-us=0)
  spy=""
  [[ $v == *+spy* && -n $SPY ]] && spy=$SPY
  (cd "$tree" && PYSPY=$spy PYSPY_ARGS="--native -r 200" \
    Q6_BSYNC=$([[ $v == *:bs* ]] && echo 1 || echo 0) PYTHONPATH=$BS:${PYTHONPATH:-} \
    timeout 90 python3 bench/frontend_cpu.py --backend cuda --rows 3584 --k 18944 \
      --frontends "$F" --hosts 8 --callers 8 --seconds "$S" --warmup 1 "${args[@]}" \
      --profile "$OUT/$tag" --json "$OUT/$tag/result.json") >"$OUT/$tag.log" 2>&1
  echo "# $v rc=$? at $(elapsed)"
  grep -v "^#   per call" "$OUT/$tag.log" | tail -4
  tar czf "$FINAL/dataplane_profile.tgz" -C "$OUT" .  # after each: a timeout keeps the rest
done
python3 - "$OUT" <<'EOF'
import glob, json, sys
print("# variant        calls/s  p50 us  p99 us  dev us/call  loop busy  inline wall/cpu  "
      "rows/batch calls/msg  fe us/call")
for path in sorted(glob.glob(f"{sys.argv[1]}/*/result.json")):
    r = json.load(open(path))
    d = r.get("device", {})
    print(f"# {path.split('/')[-2]:13} {r['calls_per_s']:8,.0f} {r.get('p50_us', 0):7,.0f} "
          f"{r.get('p99_us', 0):7,.0f} {r['device_cpu_us_per_call']:11.1f} "
          f"{d.get('loop_busy_share', 0) * 100:8.0f}% {d.get('inline_wall_us_per_call', 0):7.1f}/"
          f"{d.get('inline_cpu_us_per_call', 0):<7.1f} {r['rows_per_batch']:10.1f} "
          f"{d.get('calls_per_message', 0):9.2f} {r['frontends_cpu_us_per_call']:10.1f}")
EOF
tar czf "$FINAL/dataplane_profile.tgz" -C "$OUT" .
echo "# done at $(elapsed)"
