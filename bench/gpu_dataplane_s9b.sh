#!/usr/bin/env bash
# Issue 15, session 9, call 2: the front ends' busy polling (on by default from this tree on
# 8+ cores; Q6SERVE_FRONTEND_BUSY_POLL_US=0 is main's behaviour, the same code path otherwise)
# A/B on one machine with bench/service.py's own T2 (the closing check's command: 64 callers
# of N=1 on ffn_down, bytes, 8 front ends), alternated twice; then on top of it
# Q6SERVE_JOB_BATCHES=4 and --inline-device-us 0 (every batch on the device thread: call 1
# saw JOB_BATCHES=4 +22% on T2, which moves a lone batch under load off the loop); then T3
# (8 hosts x N=64, system regions) with and without, whether 8 spinning front ends cost T3.
#   bench/gpu_dataplane_s9b.sh   env: SECONDS_PER_RUN (1.5)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/dps9b
S=${SECONDS_PER_RUN:-1.5}
svc() {  # svc TAG TARGET [more bench/service.py args]; env: as given before the call
  local tag=$1 target=$2
  shift 2
  timeout 60 python3 bench/service.py --backend cuda --dataplane --targets "$target" \
    --modes stream --frontends 8 --t3-hosts 8 --seconds "$S" --warmup 0.3 "$@" \
    --json "$OUT/svc_$tag.json" >"$OUT/svc_$tag.log" 2>&1
  note "# $tag rc=$? at $(elapsed): $(grep -h "^T[23]" "$OUT/svc_$tag.log" | cut -c1-170 \
    | tr '\n' '|')"
  tar czf "$FINAL/dataplane_s9b.tgz" -C "$OUT" .
}
for round in a b; do
  Q6SERVE_FRONTEND_BUSY_POLL_US=0 svc t2_off_$round T2 --regions bytes
  svc t2_on_$round T2 --regions bytes
done
Q6SERVE_JOB_BATCHES=4 svc t2_on_job4 T2 --regions bytes
svc t2_on_inline0 T2 --regions bytes --inline-device-us 0
Q6SERVE_FRONTEND_BUSY_POLL_US=0 svc t3_off T3 --regions system
svc t3_on T3 --regions system
python3 - "$OUT" <<'EOF' | tee "$FINAL/table.txt"
import glob, json, sys
print("# variant         target region  rows/s    p50 us   p99 us  kernel rows/s fraction")
for path in sorted(glob.glob(f"{sys.argv[1]}/svc_*.json")):
    doc = json.load(open(path))
    for t in doc["targets"]:
        r = next((r for r in doc["runs"] if r["label"].startswith(t["target"])
                  and r["config"]["region"] == t["region"]), {})
        rps = t.get("rows_per_s", t.get("service_rows_per_s", 0.0))
        print(f"{path.rsplit('svc_', 1)[1][:-5]:16} {t['target']:6} {t['region']:6}"
              f" {rps:>8,.0f} {r.get('p50_us', 0):>8,.0f} {t['p99_us']:>8,.0f}"
              f" {t.get('kernel_rows_per_s', 0):>13,.0f} {t.get('fraction', 0):.2f}")
print(f"# {doc['device']}; commit {doc['commit']}; {doc['date']}")
EOF
tar czf "$FINAL/dataplane_s9b.tgz" -C "$OUT" .
echo "# done at $(elapsed)"
