#!/usr/bin/env bash
# Issue 14, session 15 (helper t1): the lm-head target in ONE worker process (8 callers x N=64 on
# 152064x3584, top-64, MatmulStream; limit p50 5 ms; last checks 5.07-5.38 ms, once 4.09). Where
# the loop's ~540 us a call go on the H200, and A/Bs of what cuts them, in one call:
#  (a) a profile: the worker under the steady load (PROF_AT s after the upload: past the bench's
#      untimed full-logits warm-up calls), each thread's busy fraction (/proc schedstat over
#      CPU_SECONDS, nothing attached: is the loop thread saturated?), `top -H`, then py-spy
#      (Python frames, --nonblocking: never pauses the worker) summarised by bench/spy_summary.py;
#  (b) RUNS (KIND:VARIANT, alternated in that order; lm: `bench/service.py --backend cuda
#      --lm-head --mode stream --seconds LM_SECONDS --warmup 0.3`), variants:
#        def   this tree, its defaults          base  the q6serve of $BASE (base_tree), its defaults
#        r128  this tree, --max-batch-rows 128 (two callers' rows in one batch)
#        thr   this tree, every lm-head batch's whole job (launch and wait) on the device thread,
#              none on the loop (--inline-device-us 50, Q6SERVE_DEFER_KERNEL_US=1e9)
#        env:NAME=V[,NAME=V]  this tree with those variables in the worker's environment
#  env: RUNS, LM_SECONDS (1.5), BOUND (100: no run starts after BOUND - 10 s), PROF (def: the
#  variant profiled; none: no profile), PROF_SECONDS (3), CPU_SECONDS (2), PROF_AT (6), RATE (500 Hz), BASE (a `git archive`
#  of the base tree, e.g. .gpu/t1/base) or BASE_FILES (a folder of the base's versions of the
#  files that differ, paths as in the tree: the base is this tree with those in their place)
#  a CPU rehearsal: DRY_RUN=1 BACKEND=numpy LM_EXTRA="--row-scale 0.005" bench/gpu_t1_s15.sh
# $OUT: t1s15.tgz (logs, JSON, profile), summary.txt (the table last).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1s15
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
BOUND=${BOUND:-100}
LM=(python3 bench/service.py --backend "${BACKEND:-cuda}" --lm-head --mode stream --warmup 0.3)
# shellcheck disable=SC2206
LM+=(${LM_EXTRA:-})
HERE=$PWD
# BASE_FILES: a folder of files (paths as in this tree, e.g. service/wire.py) that make the
# base variant: a copy of this tree's q6serve with those files in their place
if [[ -n ${BASE_FILES:-} && -z ${BASE:-} ]]; then
  BASE=/tmp/t1s15_base
  rm -rf "$BASE"
  mkdir -p "$BASE/proto/q6serve"
  cp -r kernels service client "$BASE/"
  cp -r proto/q6serve/v1 "$BASE/proto/q6serve/"
  (cd "$BASE_FILES" && find . -type f -name '*.py') | while read -r f; do cp "$BASE_FILES/$f" "$BASE/$f"; done
  cp "$BASE_FILES/COMMIT" "$BASE/COMMIT" 2>/dev/null
fi
if [[ -n ${BASE:-} ]]; then base_tree "$BASE"; fi

# run_variant VARIANT SECONDS JSON LOG: one bench run of VARIANT (in the background with &)
run_variant() {
  local v=$1 s=$2 json=$3 log=$4 dir=$HERE pp=${PYTHONPATH:-} args=() envs=()
  case $v in
    def) ;;
    base) pp=$BASEPP ;;  # (this tree's bench, the base tree's q6serve)
    r128) args=(--max-batch-rows 128) ;;
    thr) args=(--inline-device-us 50) envs=(Q6SERVE_DEFER_KERNEL_US=1000000000) ;;
    env:*) IFS=, read -r -a envs <<<"${v#env:}" ;;
    *) echo "unknown variant $v" >"$log"; return 2 ;;
  esac
  (cd "$dir" && env PYTHONPATH="$pp" "${envs[@]}" timeout 45 "${LM[@]}" "${args[@]}" \
    --seconds "$s" --json "$json") >"$log" 2>&1
}

# per-thread CPU seconds of process $1: "TID COMM SCHEDSTAT_S UTIME+STIME_S" per thread
thread_cpu() {
  local t hz
  hz=$(getconf CLK_TCK)
  for t in /proc/"$1"/task/*; do
    printf '%s %s %s %s\n' "${t##*/}" "$(tr ' ' _ <"$t/comm")" "$(cut -d' ' -f1 "$t/schedstat")" \
      "$(sed 's/.*) //' "$t/stat" | awk '{print $12 + $13}')"
  done 2>/dev/null | awk -v hz="$hz" '{printf "%s %s %.6f %.3f\n", $1, $2, $3 / 1e9, $4 / hz}'
}

profile() {
  # the worker under the steady load, past the bench's untimed warm-up calls (full-logits
  # unary calls at every N bucket) and the callers' start (PROF_AT s after the upload): each
  # thread's CPU over CPU_SECONDS with nothing attached, then py-spy (Python frames only,
  # --nonblocking: the process is never paused) for PROF_SECONDS
  local v=${PROF:-def} secs=${PROF_SECONDS:-3} cs=${CPU_SECONDS:-2} at=${PROF_AT:-6} run wpid
  run_variant "$v" "$((at + cs + secs + 3))" "$OUT/prof.json" "$OUT/prof_run.log" &
  run=$!
  for _ in $(seq 160); do
    grep -q "uploaded" "$OUT/prof_run.log" 2>/dev/null && break
    sleep 0.25
  done
  sleep "$at"
  wpid=$(worker_pid 8)
  if [[ -n $wpid ]]; then
    thread_cpu "$wpid" >"$OUT/cpu0.txt"
    date +%s.%N >"$OUT/cpu_t0.txt"
    top -H -b -n 2 -d "$cs" -p "$wpid" >"$OUT/top.txt" 2>&1
    thread_cpu "$wpid" >"$OUT/cpu1.txt"
    date +%s.%N >"$OUT/cpu_t1.txt"
    nvidia-smi --query-gpu=utilization.gpu,clocks.sm --format=csv,noheader >"$OUT/gpu_util.txt" 2>&1
    [[ -x $SPY ]] && timeout $((secs + 5)) "$SPY" record -p "$wpid" -d "$secs" -r "${RATE:-500}" \
      --nonblocking -t -f raw -o "$OUT/spy.raw" >"$OUT/spy.log" 2>&1
  fi
  wait "$run"
  note "# profile ($v) rc=$? ($(elapsed))"
}
[[ ${PROF:-def} != none ]] && profile

declare -A seen=()
for kv in ${RUNS:-lm:def lm:r128 lm:thr lm:def lm:r128 lm:thr}; do
  v=${kv#*:}
  r=$((${seen[$v]:-0} + 1))
  seen[$v]=$r
  tag=${v//[:=,]/_}
  if (($(date +%s) - T0 > BOUND - 10)); then
    note "# $v round $r skipped: $(elapsed) of $BOUND"
    continue
  fi
  run_variant "$v" "${LM_SECONDS:-1.5}" "$OUT/lm_${tag}_$r.json" "$OUT/lm_${tag}_$r.log"
  note "# $v round $r rc=$? ($(elapsed)): $(grep -E '^# lm-head' "$OUT/lm_${tag}_$r.log" | tail -1)"
done

# (c) the path's Python on this host's CPU (no GPU: bench/loop_lmhead.py's stub backend, 330 us
# sleeps): in process, and over real gRPC with the 8 callers in one process (LOOP=0: skip)
if [[ ${LOOP:-1} != 0 ]] && (($(date +%s) - T0 < BOUND - 12)); then
  timeout 20 python3 bench/loop_lmhead.py --calls 4000 >"$OUT/loop_inproc.log" 2>&1
  timeout 20 python3 bench/loop_lmhead.py --grpc --seconds 2 --warmup-s 1 >"$OUT/loop_grpc.log" 2>&1
  note "# loop_lmhead ($(elapsed))"
fi

{
  echo "# gpu_t1_s15 tree $(cat COMMIT 2>/dev/null) base $(cat "${BASE:-/nonexistent}/COMMIT" 2>/dev/null) ($(elapsed))"
  echo "## gpu: $(cat "$OUT/gpu_util.txt" 2>/dev/null)"
  if [[ -s $OUT/cpu1.txt ]]; then
    python3 - "$OUT" <<'EOF'
import pathlib, re, sys
out = pathlib.Path(sys.argv[1])
def read(f):
    got = {}
    for line in (out / f).read_text().splitlines():
        tid, comm, sec, ticks = line.split()
        got[tid] = (comm, float(sec), float(ticks))
    return got
c0, c1 = read("cpu0.txt"), read("cpu1.txt")
span = float((out / "cpu_t1.txt").read_text()) - float((out / "cpu_t0.txt").read_text())
names = {}
spy = out / "spy.raw"
if spy.exists():
    for line in spy.read_text().splitlines():
        m = re.match(r"thread \((\d+)\): ([^;]*)", line)
        if m:
            names[m.group(1)] = m.group(2)
print(f"## worker threads, steady load, nothing attached ({span:.1f} s): busy fraction by"
      " schedstat / by utime+stime (TID name)")
zero = ("", 0.0, 0.0)
rows = sorted(((c1[t][1] - c0.get(t, zero)[1]) / span, (c1[t][2] - c0.get(t, zero)[2]) / span, t)
              for t in c1)
for frac, frac2, t in reversed(rows):
    if frac > 0.01 or frac2 > 0.01:
        print(f"  {frac:5.2f} / {frac2:5.2f}  {t} {names.get(t, c1[t][0])}")
EOF
  fi
  echo "## top -H (second sample), the worker's busiest threads"
  awk '/^top -/{n++} n==2' "$OUT/top.txt" 2>/dev/null | grep -E "^ *[0-9]" | head -8 | cut -c1-110
  if [[ -s $OUT/spy.raw ]]; then
    echo "## py-spy (Python frames, --nonblocking), loop thread (MainThread), ${RATE:-500} Hz"
    python3 bench/spy_summary.py "$OUT/spy.raw" --thread MainThread --top 30 \
      | sed '/^leaf/,$d' | cut -c1-140
    python3 bench/spy_summary.py "$OUT/spy.raw" --thread MainThread --top 18 --under Handle._run \
      --depth 2 | sed -n '/^under/,$p' | cut -c1-170
    python3 bench/spy_summary.py "$OUT/spy.raw" --thread MainThread --top 14 --under task_step_impl \
      --depth 3 | sed -n '/^under/,$p' | cut -c1-170
    echo "## all threads"
    python3 bench/spy_summary.py "$OUT/spy.raw" --top 1 | sed -n '2,12p' | cut -c1-120
  fi
  echo "## bench/loop_lmhead.py on this host (stub backend): in process; over gRPC"
  tail -1 "$OUT/loop_inproc.log" 2>/dev/null
  tail -1 "$OUT/loop_grpc.log" 2>/dev/null
  python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("## lm-head N=64 x8 top-64, one process (in run order): p50 ms, p99 ms, calls/s, kernel us,"
      " batch rows; mean us: transport, queue, device_other, server_other")
files = sorted(out.glob("lm_*.json"), key=lambda f: f.stat().st_mtime)
for f in files + sorted(out.glob("prof.json")):
    try:
        r = json.loads(f.read_text())["runs"][0]
    except Exception as e:  # a run that died: say so
        print(f"{f.stem:<18} no result ({type(e).__name__})")
        continue
    m = r["parts_mean_us"]
    print(f"{f.stem:<18} p50 {r['p50_us'] / 1e3:5.2f}  p99 {r['p99_us'] / 1e3:5.2f}  "
          f"calls/s {r['calls_per_s']:6.0f}  kernel {r['kernel_p50_us']:4.0f}  "
          f"rows {r.get('batch_rows_mean', 0):5.1f}  tr {m['transport']:5.0f} "
          f"q {m['queue']:5.0f} dev {m['device_other']:4.0f} srv {m['server_other']:4.0f}")
EOF
} >"$OUT/summary.txt" 2>&1
tar czf "$FINAL/t1s15.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
