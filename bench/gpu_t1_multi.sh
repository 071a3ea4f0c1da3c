#!/usr/bin/env bash
# Issue 14 items 3 and 6, session 7 (helper t1): one device call, a same-machine A/B of the 7B
# decode replay within a small device budget (~160 s of script). $BASE: an older tree (a
# `git archive`), run from its own folder through a PYTHONPATH overlay (no second install);
# this tree is the one installed.
#  1. this tree's service tests of what changed, on CUDA (the direct path, multi-weight calls)
#  2. bench/service.py --replay (28 layers, S = 1, 8, 64, multi-weight and single-weight calls,
#     no bare-gRPC floor): this tree, then the base
#  3. this tree at S=64 with Q6SERVE_MMAP_THRESHOLD=$MMAP (default 32 MiB: the worker's replies
#     and requests of a few MiB from the heap, not a fresh mapping each)
# $OUT gets t1multi.tgz, progress.txt and summary.txt.   BASE=.gpu/t1/base bench/gpu_t1_multi.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1multi
S=${SECONDS_PER_RUN:-1}
MMAP=${MMAP:-33554432}
base_tree "${BASE:?set BASE to the base tree}"
Q6SERVE_TEST_BACKEND=cuda timeout 40 python3 -m pytest -q -rfE -p no:cacheprovider \
  tests/service/test_direct_path.py tests/service/test_multi_topk.py -k "direct or multi" \
  >"$OUT/pytest_service_cuda.log" 2>&1
note "# service tests on CUDA rc=$? ($(elapsed)): $(tail -1 "$OUT/pytest_service_cuda.log")"
replay() {  # label dir pythonpath seqs limit [env...]
  local label=$1 dir=$2 pp=$3 seqs=$4 limit=$5
  shift 5
  (cd "$dir" && env PYTHONPATH="$pp" "$@" timeout "$limit" python3 bench/service.py --backend cuda \
    --replay --replay-seqs "$seqs" --seconds "$S" --warmup 0.3 --no-replay-floor \
    --json "$OUT/replay_$label.json" >"$OUT/replay_$label.log" 2>&1)
  note "# replay $label rc=$? ($(elapsed))"
  grep -E "^replay S|per step" "$OUT/replay_$label.log" >>"$FINAL/progress.txt"
  tar czf "$FINAL/t1multi.tgz" -C "$OUT" .
}
replay now "$PWD" "$NOWPP" 1,8,64 75
replay base "$BASE" "$BASEPP" 1,8,64 75
replay mmap "$PWD" "$NOWPP" 64 "${MMAP_LIMIT:-40}" Q6SERVE_MMAP_THRESHOLD="$MMAP"
{
  echo "# gpu_t1_multi base $(cat "$BASE/COMMIT" 2>/dev/null) now $(cat COMMIT 2>/dev/null) $(elapsed)"
  tail -1 "$OUT/pytest_service_cuda.log"
  for l in base now mmap; do
    echo "## $l"
    grep -E "^replay S|per step" "$OUT/replay_$l.log" | sed -E 's/ +/ /g' | cut -c1-150
  done
  echo "## step p50 ms (base -> now)"
  python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
runs = {}
for label in ("base", "now", "mmap"):
    p = Path(sys.argv[1]) / f"replay_{label}.json"
    if p.exists():
        runs[label] = {r["label"]: r for r in json.loads(p.read_text()).get("replay", [])}
for name in sorted({n for r in runs.values() for n in r}):
    cells = []
    for label in ("base", "now", "mmap"):
        r = runs.get(label, {}).get(name)
        cells.append("-" if r is None else
                     f"{r['step_p50_ms']:.1f} (w {r['step_parts_p50_ms']['handler']:.1f}, "
                     f"t {r['step_parts_p50_ms']['transport']:.1f}, "
                     f"c {r['step_parts_p50_ms']['client']:.1f})")
    print(f"{name:<24} " + " | ".join(cells))
EOF
} >"$OUT/summary.txt"
tar czf "$FINAL/t1multi.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
