#!/usr/bin/env bash
# One GPU session for the service fast path (issue 14): the kernel alone (bench/kernels.py,
# ffn_down N=1 and 8), the service's targets on ffn_down (bench/service.py --target-report) and
# the 7B decode replay (--replay), with the GPU's SM/memory clocks sampled every 100 ms
# throughout (nvidia-smi; clocks.csv) and each phase's start/end in phases.txt, summarised
# last. Worker and load run in separate processes (bench/service.py starts them).
#   bench/gpu_service_run.sh          env: REPORT_ARGS, REPLAY_ARGS, SECONDS_PER_RUN
set -uo pipefail
FINAL=${OUT:-$PWD/out}
OUT=/tmp/svcrun  # everything lands here; $OUT gets one archive + the JSONs (8 files at most)
mkdir -p "$FINAL" "$OUT/report" "$OUT/replay"
export PYTHONUNBUFFERED=1
bench/gpu_run.sh none >"$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
[[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site
head -3 "$OUT/setup.log"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu,power.draw \
  --format=csv,noheader,nounits -lms 100 >"$OUT/clocks.csv" 2>&1 &
SMI=$!
phase() { echo "$1 $(date +%s.%N)" >>"$OUT/phases.txt"; }
S=${SECONDS_PER_RUN:-2}
phase idle_start; sleep 2; phase idle_end
phase kernels_start
timeout 60 python3 bench/kernels.py --shapes 3584x18944 --ns 1,8 --paths auto --no-torch \
  >"$OUT/kernels.log" 2>&1; echo "# kernels rc=$?"
phase kernels_end
grep -E "auto|3584x18944" "$OUT/kernels.log" | head -8
phase report_start
# shellcheck disable=SC2086
timeout 130 python3 bench/service.py --backend cuda --target-report --weights ffn_down \
  --modes stream --t3-hosts 8 --seconds "$S" ${REPORT_ARGS:-} \
  --json "$OUT/report/service.json" >"$OUT/report/service.log" 2>&1; echo "# report rc=$?"
phase report_end
grep -vE "^# (uploaded|bare)" "$OUT/report/service.log" | tail -16
phase replay_start
# shellcheck disable=SC2086
timeout 150 python3 bench/service.py --backend cuda --replay --seconds "$S" --warmup 0.3 \
  ${REPLAY_ARGS:-} --json "$OUT/replay/replay.json" >"$OUT/replay/replay.log" 2>&1
echo "# replay rc=$?"
phase replay_end
kill "$SMI" 2>/dev/null
grep -E "^replay|^    per step|uploaded|FAILED" "$OUT/replay/replay.log" | head -20
python3 - "$OUT" <<'EOF'
import sys, statistics
out = sys.argv[1]
marks = dict((l.split()[0], float(l.split()[1])) for l in open(f"{out}/phases.txt"))
rows = []
for line in open(f"{out}/clocks.csv"):
    p = [x.strip() for x in line.split(",")]
    try:
        import datetime as dt
        t = dt.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((t, float(p[1]), float(p[2]), float(p[3])))
    except (ValueError, IndexError):
        pass
for ph in ("idle", "kernels", "report", "replay"):
    a, b = marks.get(ph + "_start"), marks.get(ph + "_end")
    sel = [r for r in rows if a is not None and b is not None and a <= r[0] <= b]
    if sel:
        sm = [r[1] for r in sel]
        print(f"# clocks {ph:8} n={len(sel):4} SM MHz min {min(sm):.0f} p50 "
              f"{statistics.median(sm):.0f} max {max(sm):.0f}  mem MHz p50 "
              f"{statistics.median(r[2] for r in sel):.0f}  util% p50 "
              f"{statistics.median(r[3] for r in sel):.0f}")
EOF
tar czf "$FINAL/service_run.tgz" -C "$OUT" . && cp "$OUT/report/service.json" \
  "$OUT/replay/replay.json" "$OUT/kernels.log" "$FINAL/" 2>/dev/null; ls "$FINAL"
