#!/usr/bin/env bash
# One GPU session comparing two trees on the data plane (issue 15), same machine: this tree
# ("new") and OLD (a copy of another commit): bench/service.py --dataplane (T2: 64 callers
# of N=1 on ffn_down; T3: 8 hosts of N=64; bytes and shm regions) for FRONTENDS of the new
# tree and OLD_FRONTENDS of the old one, bench/frontend_cpu.py --profile (T2 with the device
# process's counters) for PROFILE variants, and bench/lane_latency.py (new tree).
# BENCH_FIX=1: bench/service.py's `one` passes region/own_channel by keyword (before the fix
# they landed in run()'s topk/region parameters: every --dataplane run used shm regions and a
# connection per host); applied to both copies with sed, the result printed.
#   OLD=../dp_old bench/gpu_dataplane_ab.sh   env: SECONDS_PER_RUN (2), FRONTENDS ("8 4"),
#   OLD_FRONTENDS ("8"), PROFILE ("8 8:s1": F[:s1] = Q6SERVE_FRONTEND_STACKS=1), BENCH_FIX (1)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dpab
S=${SECONDS_PER_RUN:-2}
NEW=$PWD
OLD=${OLD:+$(cd "$OLD" && pwd)}
fix() {  # $1: tree
  [[ ${BENCH_FIX:-1} == 1 ]] || return 0
  sed -i 's/got = self.run(label, \[weight\], hosts, callers, n, mode, region, own_channel)/got = self.run(label, [weight], hosts, callers, n, mode, region=region,\n                       own_channel=own_channel)/' "$1/bench/service.py"
  echo "# $1: bench fix $(grep -c 'own_channel=own_channel)' "$1/bench/service.py")"
}
official() {  # $1 tag, $2 tree, $3 front ends
  (cd "$2" && timeout 80 python3 bench/service.py --backend cuda --dataplane --modes stream \
    --frontends "$3" --t3-hosts 8 --seconds "$S" --warmup 0.5 --json "$OUT/$1.json") \
    >"$OUT/$1.log" 2>&1
  echo "# $1 rc=$? at $(elapsed)"
  mv "$OUT/worker.log" "$OUT/worker_$1.log" 2>/dev/null
  grep -E "^T[23] " "$OUT/$1.log" | cut -c1-150
}
fix "$NEW"
for F in ${FRONTENDS:-8 4}; do official "new_f$F" "$NEW" "$F"; done
for v in ${PROFILE:-8 8:s1}; do
  F=${v%%:*}
  tag=prof_f$F$([[ $v == *:s1* ]] && echo _s1)
  Q6SERVE_FRONTEND_STACKS=$([[ $v == *:s1* ]] && echo 1) timeout 60 python3 bench/frontend_cpu.py \
    --backend cuda --rows 3584 --k 18944 --frontends "$F" --hosts 8 --callers 8 --seconds 4 \
    --warmup 1 --profile "$OUT/$tag" --json "$OUT/$tag/result.json" >"$OUT/$tag.log" 2>&1
  echo "# $tag rc=$? at $(elapsed)"
  grep -v "^#   per call" "$OUT/$tag.log" | tail -3 | cut -c1-250
done
timeout 60 python3 bench/lane_latency.py --backend cuda --rows 3584 --k 18944 --seconds 1.5 \
  --json "$OUT/lane.json" >"$OUT/lane.log" 2>&1
echo "# lane rc=$? at $(elapsed)"; grep -v "^#" "$OUT/lane.log" | tail -4
tar czf "$FINAL/dataplane_ab.tgz" -C "$OUT" .
if [[ -n $OLD ]]; then
  fix "$OLD"
  (cd "$OLD" && python3 -m pip install -q --no-deps --no-build-isolation -e . \
    >"$OUT/install_old.log" 2>&1) || tail -3 "$OUT/install_old.log"
  for F in ${OLD_FRONTENDS:-8}; do official "old_f$F" "$OLD" "$F"; done
  (cd "$NEW" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1)
fi
python3 - "$OUT" <<'EOF'
import glob, json, sys
print("# run      target x/y via   rows/s      p99 us  kernel rows/s  fraction")
for path in sorted(glob.glob(f"{sys.argv[1]}/*_f*.json")):
    if "/prof_" in path:
        continue
    doc = json.load(open(path))
    for t in doc["targets"]:
        rps = t.get("rows_per_s", t.get("service_rows_per_s", 0.0))
        print(f"# {path.split('/')[-1][:-5]:8} {t['target']:6} {t['region']:7} {rps:>10,.0f} "
              f"{t['p99_us']:>10,.0f} {t.get('kernel_rows_per_s', 0):>13,.0f} "
              f"{t.get('fraction', 0):>9.2f}")
EOF
tar czf "$FINAL/dataplane_ab.tgz" -C "$OUT" .
echo "# done at $(elapsed)"
