#!/usr/bin/env bash
# Issue 15, session 9, round 3: what makes T2's tail (64 callers of N=1 on ffn_down 3584x18944,
# f16, bytes, a connection per caller), main (./base) vs this tree, alternated on one machine,
# at --frontends 4 and 8: bench/frontend_cpu.py (this tree's) runs each worker with two loads
# of 8x8 (two runs a worker) and prints, besides rows/s and p50/p99, each front end's
# connections (SO_REUSEPORT's spread), its share of a core and its calls a second (from the
# bytes it wrote) with its callers' mean time by Little's law, and what the slowest 1% of
# calls are made of (mean of each part) against the mean. This tree's device process writes
# the answers of the calls it ran on the direct path in the trip that ran them (not a loop
# iteration later). A table last.
#   bench/gpu_dataplane_s9d.sh   (./base: main's tree)   env: SECONDS_PER_RUN (1.0)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps9d
base_tree base
S=${SECONDS_PER_RUN:-1.0}
T2=(--backend cuda --rows 3584 --k 18944 --n 1 --precision f16 --seconds "$S" --warmup 0.3
    --loads 8x8,8x8)
v() {  # v TAG PYTHONPATH FRONTENDS
  PYTHONPATH=$2 timeout 50 python3 bench/frontend_cpu.py "${T2[@]}" --frontends "$3" \
    --json "$OUT/fe_$1.json" >"$OUT/fe_$1.log" 2>&1
  note "# $1 rc=$? at $(elapsed): $(grep -h "^frontends=" "$OUT/fe_$1.log" | cut -c1-200)"
  tar czf "$FINAL/dataplane_s9d.tgz" -C "$OUT" .
}
v main_f4 "$BASEPP" 4
v tree_f4 "$NOWPP" 4
v tree_f8 "$NOWPP" 8
v main_f8 "$BASEPP" 8
python3 - "$OUT" <<'PY' | tee "$FINAL/table.txt"
import json, sys
print("# run      load  rows/s  p50 us  p99 us  dev  fe sum/max  per front end, busiest first: "
      "conns:cores:ms (Little)  | slowest 1% / mean us: transport, server_other")
for tag in ("main_f4", "tree_f4", "tree_f8", "main_f8"):
    try:
        rs = json.load(open(f"{sys.argv[1]}/fe_{tag}.json"))
    except OSError:
        continue
    for i, r in enumerate(rs if isinstance(rs, list) else [rs]):
        c, m, t = r["cpu"], r["parts_mean_us"], r["tail_mean_us"]
        rb = r.get("reply_bytes") or 0
        fronts = sorted(c.get("per_front", {}).values(), key=lambda f: -f["cores"])
        per = " ".join(f"{f['conns']}:{f['cores']:.2f}" + (
            f":{f['conns'] / (f['bytes_out_per_s'] / rb) * 1e3:.1f}"
            if rb and f.get("bytes_out_per_s") and f["conns"] else "") for f in fronts)
        print(f"{tag:8} {i:>4} {r['rows_per_s']:>7,.0f} {r['p50_us']:>7,.0f} "
              f"{r['p99_us']:>7,.0f} {c.get('device', 0):>4.2f} "
              f"{sum(c.get('fronts', [])):>5.2f}/{max(c.get('fronts', [0])):.2f}  {per}  | "
              f"{t.get('transport', 0):,.0f}/{m.get('transport', 0):,.0f}, "
              f"{t.get('server_other', 0):,.0f}/{m.get('server_other', 0):,.0f}")
PY
tar czf "$FINAL/dataplane_s9d.tgz" -C "$OUT" .
echo "# done at $(elapsed)"
