#!/usr/bin/env bash
# One GPU session for issue 15, session 10 (helper dp), most important first, each step's logs
# archived into $FINAL as it ends:
# 1. the GPU test of the lane's pipeline of full batches (tests/dataplane/test_pinned_gpu.py -k
#    lane: T3's shape on lanes through two front ends, y against the bytes path);
# 2. T3 through the fast lane (8 hosts x 4 callers of N=64 on ffn_down, x and y in each
#    caller's page-locked region, bench/frontend_cpu.py --lane): this tree against BASE (a copy
#    of main without the pipeline, imported ahead of the install: gpu_lib.sh base_tree),
#    alternated, plus BASE with Q6SERVE_JOB_BATCHES=4 once (the earlier way to overlap);
# 3. T2's spread (Q6SERVE_FRONTEND_ROUND_ROBIN=1 against the kernel's SO_REUSEPORT hash, this
#    tree, alternated at --frontends 4 and 8; bench/gpu_dataplane_s9e.sh's runs).
# A short table last.
#   BASE=base bench/gpu_dataplane_s10.sh   env: SECONDS_PER_RUN (2), SKIP_RR, SKIP_TESTS
#   DRY_RUN=1 BACKEND=numpy ROWS=64 K=512 BASE=/tmp/base OUT=/tmp/o bench/gpu_dataplane_s10.sh
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps10
S=${SECONDS_PER_RUN:-2}
BACKEND=${BACKEND:-cuda} ROWS=${ROWS:-3584} K=${K:-18944}  # (a CPU rehearsal: numpy, small)
base_tree "${BASE:-base}"
archive() { tar czf "$FINAL/dataplane_s10.tgz" -C "$OUT" .; }
if [[ -z ${SKIP_TESTS:-} ]]; then
  timeout 60 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    tests/dataplane/test_pinned_gpu.py -k lane >"$OUT/pytest_lane_gpu.log" 2>&1
  note "# gpu test rc=$? ($(tail -1 "$OUT/pytest_lane_gpu.log")) at $(elapsed)"
  grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest_lane_gpu.log" | head -6 | cut -c1-240
fi
lane() {  # lane TAG PYTHONPATH [ENV...]
  local tag=$1 pp=$2
  shift 2
  env "$@" PYTHONPATH="$pp" timeout 45 python3 bench/frontend_cpu.py --backend "$BACKEND" \
    --rows "$ROWS" --k "$K" --n 64 --lane --frontends 1 --hosts 8 --callers 4 --seconds "$S" \
    --warmup 0.5 --json "$OUT/lane_$tag.json" >"$OUT/lane_$tag.log" 2>&1
  note "# lane $tag rc=$? at $(elapsed): $(grep -h "^frontends=" "$OUT/lane_$tag.log" \
    | cut -c1-260)"
  archive
}
lane new1 "$NOWPP"
lane base1 "$BASEPP"
lane new2 "$NOWPP"
lane base2 "$BASEPP"
lane base_jb4 "$BASEPP" Q6SERVE_JOB_BATCHES=4
T2=(--backend "$BACKEND" --rows "$ROWS" --k "$K" --n 1 --precision f16 --seconds 1.0 --warmup 0.3
    --loads 8x8,8x8)
rr() {  # rr TAG ROUND_ROBIN FRONTENDS
  Q6SERVE_FRONTEND_ROUND_ROBIN=$2 timeout 50 python3 bench/frontend_cpu.py "${T2[@]}" \
    --frontends "$3" --json "$OUT/fe_$1.json" >"$OUT/fe_$1.log" 2>&1
  note "# $1 rc=$? at $(elapsed): $(grep -h "^frontends=" "$OUT/fe_$1.log" | cut -c1-200)"
  grep -h "round robin\|in turn\|eBPF\|reuseport" "$OUT/fe_$1.log" "$OUT"/worker*.log \
    2>/dev/null | head -2 | cut -c1-200
  archive
}
if [[ -z ${SKIP_RR:-} ]]; then
  rr hash_f4 0 4
  rr rr_f4 1 4
  rr rr_f8 1 8
  rr hash_f8 0 8
fi
python3 - "$OUT" <<'PY' | tee "$FINAL/table.txt"
import glob, json, os, sys
out = sys.argv[1]
print("# lane run   rows/s   p50 us   p99 us  device cores  device CPU us/call (window)")
for path in sorted(glob.glob(f"{out}/lane_*.json")):
    r = json.load(open(path))
    r = r[0] if isinstance(r, list) else r
    print(f"# {os.path.basename(path)[5:-5]:9} {r['rows_per_s']:>8,.0f} {r['p50_us']:>8,.0f} "
          f"{r['p99_us']:>8,.0f} {r['cpu'].get('device', 0):>6.2f} "
          f"{r.get('device_window_cpu_us_per_call', 0):>10,.0f}")
print("# T2 run    load  rows/s  p50 us  p99 us  dev  fe sum/max  conns:cores per front end")
for tag in ("hash_f4", "rr_f4", "rr_f8", "hash_f8"):
    try:
        rs = json.load(open(f"{out}/fe_{tag}.json"))
    except OSError:
        continue
    for i, r in enumerate(rs if isinstance(rs, list) else [rs]):
        c = r["cpu"]
        fronts = sorted(c.get("per_front", {}).values(), key=lambda f: -f["cores"])
        per = " ".join(f"{f['conns']}:{f['cores']:.2f}" for f in fronts)
        print(f"# {tag:8} {i:>3} {r['rows_per_s']:>7,.0f} {r['p50_us']:>7,.0f} "
              f"{r['p99_us']:>7,.0f} {c.get('device', 0):>4.2f} "
              f"{sum(c.get('fronts', [])):>5.2f}/{max(c.get('fronts', [0])):.2f}  {per}")
PY
archive
echo "# done at $(elapsed)"
