#!/usr/bin/env bash
# One GPU session for the service fast path (issue 14), <= ~270 s with the install:
#  1. the kernel alone: bench/kernels.py, ffn_down 3584x18944 N=1, AUTO path (kernels.log);
#  2. one worker for T1 (one caller, N=1, f16, ffn_down, MatmulStream, against a bare gRPC echo
#     of the same sizes), the lm-head target (N=64, 8 callers, top-64) and the 7B decode replay
#     (S = 1, 8, 64, with and without multi-weight calls, f16 y): bench/service.py --target-report
#     --targets T1 --lm-head --replay (main.json, main.log);
#  3. T1 again with the GIL hand-off yield off (Q6SERVE_HANDOFF_YIELD=0: the A/B of that change;
#     yield0.json);
# with the GPU's SM/memory clocks sampled every 100 ms throughout (clocks.csv, phases.txt). Worker
# and load run in separate processes (bench/service.py starts them). $OUT gets the JSONs, the
# kernel log, a summary table (summary.txt, also printed last) and every log in one archive.
#   bench/gpu_service_run.sh          env: SECONDS_PER_RUN (2), MAIN_ARGS, SKIP_AB=1
set -uo pipefail
FINAL=${OUT:-$PWD/out}
OUT=/tmp/svcrun  # everything lands here; $FINAL gets 6 files (the device tool takes 8 at most)
rm -rf "$OUT"
mkdir -p "$FINAL" "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
bench/gpu_run.sh none >"$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
[[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site
head -3 "$OUT/setup.log"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,utilization.gpu,power.draw \
  --format=csv,noheader,nounits -lms 100 >"$OUT/clocks.csv" 2>&1 &
SMI=$!
phase() { echo "$1 $(date +%s.%N)" >>"$OUT/phases.txt"; }
S=${SECONDS_PER_RUN:-2}
phase idle_start; sleep 1; phase idle_end
phase kernels_start
timeout 40 python3 bench/kernels.py --shapes 3584x18944 --ns 1 --paths auto --no-torch \
  >"$OUT/kernels.log" 2>&1; echo "# kernels rc=$? ($(($(date +%s) - T0)) s)"
phase kernels_end
phase main_start
# shellcheck disable=SC2086
timeout 170 python3 bench/service.py --backend cuda --target-report --targets T1 \
  --modes stream --weights ffn_down --lm-head --mode stream --replay --seconds "$S" \
  --warmup 0.3 ${MAIN_ARGS:-} --json "$OUT/main.json" >"$OUT/main.log" 2>&1
echo "# main rc=$? ($(($(date +%s) - T0)) s)"
phase main_end
if [[ -z ${SKIP_AB:-} ]]; then
  phase yield0_start
  Q6SERVE_HANDOFF_YIELD=0 timeout 45 python3 bench/service.py --backend cuda --target-report \
    --targets T1 --modes stream --weights ffn_down --seconds "$S" --warmup 0.3 \
    --json "$OUT/yield0.json" >"$OUT/yield0.log" 2>&1
  echo "# yield0 rc=$? ($(($(date +%s) - T0)) s)"
  phase yield0_end
fi
kill "$SMI" 2>/dev/null
grep -E "FAILED|Error|error" "$OUT/main.log" "$OUT/yield0.log" 2>/dev/null | head -5
python3 - "$OUT" >"$OUT/summary.txt" <<'EOF'
import datetime as dt, json, os, re, statistics, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(f"{out}/{name}"))
    except (OSError, ValueError):
        return None
marks = dict((l.split()[0], float(l.split()[1])) for l in open(f"{out}/phases.txt"))
rows = []
clocks = f"{out}/clocks.csv"
for line in open(clocks) if os.path.exists(clocks) else []:
    p = [x.strip() for x in line.split(",")]
    try:
        t = dt.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((t, float(p[1]), float(p[2]), float(p[3])))
    except (ValueError, IndexError):
        pass
for ph in ("idle", "kernels", "main", "yield0"):
    a, b = marks.get(ph + "_start"), marks.get(ph + "_end")
    sel = [r for r in rows if a is not None and b is not None and a <= r[0] <= b]
    if sel:
        sm = [r[1] for r in sel]
        print(f"# clocks {ph:8} n={len(sel):4} SM MHz min {min(sm):.0f} p50 "
              f"{statistics.median(sm):.0f} max {max(sm):.0f}  mem MHz p50 "
              f"{statistics.median(r[2] for r in sel):.0f}")
kern = None
for line in open(f"{out}/kernels.log", errors="replace"):
    m = re.match(r"\s*3584x18944\s+1\s+auto=\S+\s+([\d.]+)", line)
    if m:
        kern = float(m.group(1))
print(f"# kernel alone (bench/kernels.py, ffn_down N=1 f16 AUTO): {kern} us")
doc = load("main.json") or {}
print(f"# {doc.get('device')}  commit {doc.get('commit')}  {doc.get('date')}")
for name, d in (("T1 (yield on)", doc), ("T1 yield off", load("yield0.json"))):
    for t in (d or {}).get("targets", []):
        r = next((x for x in d["runs"] if x["label"] == t["run"]), None)
        if r is None:
            continue
        pp = r["parts_p50_us"]
        ratio = f"{r['kernel_p50_us'] / kern:.2f}x" if kern and r["kernel_p50_us"] else "n/a"
        print(f"{name:14} p50 {r['p50_us']:.0f} us  p50-kernel {t['p50_minus_kernel_us']:.0f} "
              f"(limit {t['limit_us']:.0f} = bare {t['bare_grpc_p50_us']:.0f} + 100)  kernel "
              f"p50 {r['kernel_p50_us']:.1f} us = {ratio} of kernels.py\n    p50 us: "
              + " ".join(f"{k} {v:.0f}" for k, v in pp.items()))
lm = doc.get("lm_head")
if lm:
    print(f"lm-head N={lm['n']} x{lm['callers']} top-{lm['topk']}: reply {lm['reply_bytes']:,.0f} B "
          f"vs f32 logits {lm['f32_logits_bytes']:,} B = {lm['ratio']:,.0f}x; p50 "
          f"{lm['p50_us'] / 1e3:.2f} ms p99 {lm['p99_us'] / 1e3:.2f} ms (kernel p50 "
          f"{(lm['kernel_p50_us'] or 0) / 1e3:.2f} ms, batch rows {lm['batch_rows_mean']:.0f}) "
          f"{'met' if lm['met'] else 'MISSED'}")
print(f"{'replay':18} {'calls':>5} {'steps/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'kern ms':>7} "
      f"{'bare ms':>7} {'limit':>6} {'transp':>6} {'worker':>6} {'device':>6} {'queue':>6} "
      f"{'client':>6}")
for r in doc.get("replay", []):
    p = r["step_parts_p50_ms"]
    lim = "-" if r["limit_ms"] is None else f"{r['limit_ms']:.0f}"
    print(f"{r['label']:18} {r['calls_per_step']:5} {r['steps_per_s']:7.2f} "
          f"{r['step_p50_ms']:8.1f} {r['step_p99_ms']:8.1f} {r['kernel_step_ms'] or 0:7.2f} "
          f"{r['floor_step_ms']:7.1f} {lim:>6} {p['transport']:6.1f} {p['handler']:6.1f} "
          f"{p['device']:6.1f} {p['queue']:6.1f} {p['client']:6.1f}")
for e in doc.get("errors", []):
    print(f"ERROR {e['run']}: {e['error'][:200]}")
EOF
tar czf "$FINAL/service_run.tgz" -C "$OUT" .
cp "$OUT"/main.json "$OUT"/yield0.json "$OUT"/kernels.log "$OUT"/summary.txt "$FINAL/" 2>/dev/null
echo "# total $(($(date +%s) - T0)) s"
cat "$OUT/summary.txt"
