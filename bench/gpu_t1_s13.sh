#!/usr/bin/env bash
# Issue 14, session 13, the lead's bundle A (bound 70 s): the lm-head target in one process
# (8 callers x N=64 on 152064x3584, top-64, MatmulStream; p50 5.10 ms against 5 ms at the
# session 12 closing check, 64-row batches: one request each, ~1,526 calls/s, so ~655 us a
# call for ~330 us of GPU). Is the loop thread saturated, or does the GPU wait for it? (a) The
# worker under the load sampled by `top -H` (CPU per thread) and py-spy --native (the loop's
# frames, gRPC's C frames included).
# (b) Alternated A/B of the two deferred-launch switches (service/batcher.py, off by default):
# Q6SERVE_DEFER_NOW=1 (the next deferred batch launched in the loop trip that hears of the
# previous one's end, not by the batcher's task a trip later; no task wake-up per request
# while no batch may launch) and Q6SERVE_DEFER_SLOTS=3 (three deferred batches in flight
# instead of two: the launcher has three slots). (c) A 4-layer decode replay at S = 1, 8 with
# multi-weight calls, Q6SERVE_MULTI_PIPELINE=1 (a multi-weight call's parts launched behind
# each other on the direct path, service/multi.py) against off.
#   bench/gpu_t1_s13.sh   env: RUNS (KIND:VARIANT list; variants base now s3 s3now pipe, and
#                         off / def: the three switches as in session 12 / the tree's defaults),
#                         LM_SECONDS (1.0), RP_SECONDS (1.0), RP_SEQS (1,8),
#                         BOUND (66: no run starts after BOUND - 8 s), SPY_SECONDS (3, whole seconds: py-spy; 0: none),
#                         RATE (250 Hz), SPY_VARIANT (base), SPY_AT (first; last: after the
#                         runs, if BOUND - 14 s is not past)
#   a CPU rehearsal: DRY_RUN=1 BACKEND=numpy LM_EXTRA="--row-scale 0.005" bench/gpu_t1_s13.sh
# $OUT: t1s13.tgz (logs, JSON, profile), summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1s13
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
BOUND=${BOUND:-66}
LM=(python3 bench/service.py --backend "${BACKEND:-cuda}" --lm-head --mode stream --warmup 0.2)
# shellcheck disable=SC2206
LM+=(${LM_EXTRA:-})

variant_env() {  # the environment of a variant
  case $1 in
    base) echo "Q6SERVE_DEFER_NOW=0" ;;
    now) echo "Q6SERVE_DEFER_NOW=1" ;;
    s3) echo "Q6SERVE_DEFER_SLOTS=3" ;;
    s3now) echo "Q6SERVE_DEFER_SLOTS=3 Q6SERVE_DEFER_NOW=1" ;;
    pipe) echo "Q6SERVE_MULTI_PIPELINE=1" ;;
    off) echo "Q6SERVE_DEFER_SLOTS=2 Q6SERVE_DEFER_NOW=0 Q6SERVE_MULTI_PIPELINE=0" ;;  # (s12's)
    def) echo "Q6SERVE_HANDOFF_YIELD=1" ;;  # the defaults (that one is the default too)
  esac
}

# (a) the profile: a worker (variant SPY_VARIANT, base unless said) under top -H and py-spy
# while it serves the lm-head load; first, or with SPY_AT=last after the runs if the time allows
profile() {
  local run spy wpid
  # shellcheck disable=SC2046
  env $(variant_env "${SPY_VARIANT:-base}") timeout 20 "${LM[@]}" \
    --seconds "$((${SPY_SECONDS:-3} + 2))" --json "$OUT/spy.json" >"$OUT/spy_run.log" 2>&1 &
  run=$!
  for _ in $(seq 60); do
    grep -q "uploaded" "$OUT/spy_run.log" 2>/dev/null && break
    sleep 0.25
  done
  sleep 1.5  # past the bench's warm-up calls
  wpid=$(pgrep -f "q6serve.client.cli worker" | head -1)
  if [[ -n $wpid ]]; then
    [[ -x $SPY ]] && timeout 8 "$SPY" record -p "$wpid" -d "${SPY_SECONDS:-3}" -r "${RATE:-250}" \
      --native -t -f raw -o "$OUT/spy.raw" >"$OUT/spy.log" 2>&1 &
    spy=$!
    top -H -b -n 2 -d 1 -p "$wpid" >"$OUT/top.txt" 2>&1
    nvidia-smi --query-gpu=utilization.gpu,clocks.sm --format=csv,noheader >"$OUT/gpu_util.txt" 2>&1
    wait "$spy"
  fi
  wait "$run"
  note "# profile run (${SPY_VARIANT:-base}) rc=$? ($(elapsed))"
}
[[ ${SPY_SECONDS:-3} != 0 && ${SPY_AT:-first} == first ]] && profile

# (b) the A/Bs, in RUNS order (KIND:VARIANT; lm: the lm-head target, rp: a 4-layer replay at
# S = 1 and 8 with multi-weight calls, the lm-head top-k included; no floor)
RP=(python3 bench/service.py --backend "${BACKEND:-cuda}" --replay --layers "${RP_LAYERS:-4}"
  --replay-seqs "${RP_SEQS:-1,8}" --multi on --no-replay-floor --warmup 0.3)
# shellcheck disable=SC2206
RP+=(${RP_EXTRA:-})
declare -A seen=()
for kv in ${RUNS:-lm:base lm:s3now lm:base lm:s3now rp:base rp:pipe lm:now lm:s3 rp:base rp:pipe}; do
  kind=${kv%%:*} v=${kv#*:}
  r=$((${seen[$kv]:-0} + 1))
  seen[$kv]=$r
  need=8
  [[ $kind == rp ]] && need=14  # what a run takes, start and upload included
  if (($(date +%s) - T0 > BOUND - need)); then
    note "# $kv round $r skipped: $(elapsed) of $BOUND"
    continue
  fi
  if [[ $kind == lm ]]; then
    # shellcheck disable=SC2046
    env $(variant_env "$v") timeout 15 "${LM[@]}" --seconds "${LM_SECONDS:-1.0}" \
      --json "$OUT/lm_${v}_$r.json" >"$OUT/lm_${v}_$r.log" 2>&1
  else
    # shellcheck disable=SC2046
    env $(variant_env "$v") timeout 22 "${RP[@]}" --seconds "${RP_SECONDS:-1.0}" \
      --json "$OUT/rp_${v}_$r.json" >"$OUT/rp_${v}_$r.log" 2>&1
  fi
  note "# $kv round $r rc=$? ($(elapsed))"
done

if [[ ${SPY_SECONDS:-3} != 0 && ${SPY_AT:-first} == last ]]; then
  if (($(date +%s) - T0 > BOUND - 14)); then
    note "# profile skipped: $(elapsed) of $BOUND"
  else
    profile
  fi
fi

{
  echo "# gpu_t1_s13 tree $(cat COMMIT 2>/dev/null) ($(elapsed))"
  python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("# lm-head N=64 x8 top-64, one process: variant round: p50 ms, p99 ms, calls/s; mean us:"
      " transport, queue, device_other, server_other")
for f in sorted(out.glob("lm_*.json")) + sorted(out.glob("spy.json")):
    try:
        r = json.loads(f.read_text())["runs"][0]
    except Exception as e:  # a run that died: say so
        print(f"{f.stem:<12} no result ({type(e).__name__})")
        continue
    m = r["parts_mean_us"]
    print(f"{f.stem:<12} p50 {r['p50_us'] / 1e3:5.2f}  p99 {r['p99_us'] / 1e3:5.2f}  "
          f"calls/s {r['calls_per_s']:6.0f}  kernel {r['kernel_p50_us']:4.0f}  "
          f"tr {m['transport']:5.0f} q {m['queue']:5.0f} dev {m['device_other']:4.0f} "
          f"srv {m['server_other']:4.0f}")
print("# replay (4 layers + lm-head top-64, multi on): S: step p50 / p99 ms; per step p50 ms:"
      " worker (device), transport, client; calls/step")
for f in sorted(out.glob("rp_*.json")):
    try:
        rs = json.loads(f.read_text())["replay"]
    except Exception as e:
        print(f"{f.stem:<12} no result ({type(e).__name__})")
        continue
    cells = []
    for r in rs:
        p = r["step_parts_p50_ms"]
        cells.append(f"{r['label'].split()[1]}: {r['step_p50_ms']:6.2f} / {r['step_p99_ms']:6.2f}"
                     f"  w {p['handler']:5.2f} ({p['device']:5.2f}) tr {p['transport']:5.2f} "
                     f"cl {p['client']:4.2f} c {r['calls_per_step']}")
    print(f"{f.stem:<12} " + " | ".join(cells))
EOF
  echo "## gpu: $(cat "$OUT/gpu_util.txt" 2>/dev/null)"
  echo "## top -H (second sample), the worker's busiest threads"
  awk '/^top -/{n++} n==2' "$OUT/top.txt" 2>/dev/null | grep -E "^ *[0-9]" | head -8 | cut -c1-110
  if [[ -s $OUT/spy.raw ]]; then
    echo "## py-spy --native, loop thread (MainThread), ${RATE:-250} Hz x ${SPY_SECONDS:-3} s"
    python3 bench/spy_summary.py "$OUT/spy.raw" --thread MainThread --top 40 \
      | sed '/^leaf/,$d' | cut -c1-140
    python3 bench/spy_summary.py "$OUT/spy.raw" --thread MainThread --top 16 --under task_step_impl \
      --depth 3 | sed -n '/^under/,$p' | cut -c1-170
    python3 bench/spy_summary.py "$OUT/spy.raw" --thread MainThread --top 12 --under Handle._run \
      --depth 2 | sed -n '/^under/,$p' | cut -c1-170
    echo "## all threads"
    python3 bench/spy_summary.py "$OUT/spy.raw" --top 1 | sed -n '2,12p' | cut -c1-120
  fi
} >"$OUT/summary.txt" 2>&1
tar czf "$FINAL/t1s13.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
