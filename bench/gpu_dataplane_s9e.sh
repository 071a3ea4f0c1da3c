#!/usr/bin/env bash
# Issue 15: T2's tail and SO_REUSEPORT's spread. Q6SERVE_FRONTEND_ROUND_ROBIN=1 (new connections
# dealt to the front ends in turn by an eBPF SK_REUSEPORT program, service/reuseport.py) against
# the kernel's hash, one tree, alternated on one machine, at --frontends 4 and 8 (two loads of
# 8x8 a worker): rows/s, p50/p99, each front end's connections and cores, the slowest 1% of
# calls' parts. The worker logs a warning and keeps the hash where the kernel refuses the
# program (no CAP_BPF / CAP_NET_ADMIN): the rr runs' connection columns show which happened.
#   bench/gpu_dataplane_s9e.sh   env: SECONDS_PER_RUN (1.0)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps9e
S=${SECONDS_PER_RUN:-1.0}
T2=(--backend cuda --rows 3584 --k 18944 --n 1 --precision f16 --seconds "$S" --warmup 0.3
    --loads 8x8,8x8)
v() {  # v TAG ROUND_ROBIN FRONTENDS
  Q6SERVE_FRONTEND_ROUND_ROBIN=$2 timeout 50 python3 bench/frontend_cpu.py "${T2[@]}" --frontends "$3" \
    --json "$OUT/fe_$1.json" >"$OUT/fe_$1.log" 2>&1
  note "# $1 rc=$? at $(elapsed): $(grep -h "^frontends=" "$OUT/fe_$1.log" | cut -c1-200)"
  tar czf "$FINAL/dataplane_s9e.tgz" -C "$OUT" .
}
v hash_f4 0 4
v rr_f4 1 4
v rr_f8 1 8
v hash_f8 0 8
python3 - "$OUT" <<'PY' | tee "$FINAL/table.txt"
import json, sys
print("# run      load  rows/s  p50 us  p99 us  dev  fe sum/max  per front end, busiest first: "
      "conns:cores:ms (Little)  | slowest 1% / mean us: transport, server_other")
for tag in ("hash_f4", "rr_f4", "rr_f8", "hash_f8"):
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
tar czf "$FINAL/dataplane_s9e.tgz" -C "$OUT" .
echo "# done at $(elapsed)"
