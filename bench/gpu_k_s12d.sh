#!/usr/bin/env bash
# k's bundle-A3 command (session 12, round 2: the load path of the pair-stream repack), bounded
# by CALL_S (28 s from the start of the install) inside the lead's call:
#   1. tests/kernels/test_cuda_pairs.py's load-path tests: the device repack's bytes against
#      pairs_ref (session 11's kernel, bit for bit) at chunk/slab offsets mid-warp, the inverse on
#      a block range, the kill switch (pairs -> AoS -> plain SoA -> pairs: the bytes exact), the
#      VRAM figures with pairs on/off, read-back/relayout;
#   2. bench/pair_load.py: load wall of 4096x14336 (48 MB) and 152064x3584 (447 MB) with pairs
#      off vs on (median of 3, alternated), the new repack/unpack beside session 11's on one
#      64 MB slab (events) and their bits compared.
# Run: `bash bench/gpu_k_s12d.sh` from the tree's root (gpu_session installs the wheels).
# CPU rehearsal: DRY_RUN=1 OUT=/tmp/o PATH=$PWD/.venv/bin:$PATH bash bench/gpu_k_s12d.sh
set -uo pipefail
source bench/gpu_lib.sh
gpu_session /tmp/ks12d
CALL_S=${CALL_S:-28}
left() { echo $((CALL_S - $(date +%s) + T0)); }
bound() { local l; l=$(($(left) - ${2:-0})); ((l < $1)) && echo "$l" || echo "$1"; }
note "# setup done $(elapsed)"
t=$(bound 13 9)
timeout "$t" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_cuda_pairs.py \
  -k "reference_order or kill_switch or vram or read_back or keeps_scales" >"$OUT/pair_tests.log" 2>&1
note "# pair tests rc=$? (bound ${t} s) $(elapsed)"
t=$(bound 20 1)
timeout "$t" python3 bench/pair_load.py --json "$OUT/pair_load.json" >"$OUT/pair_load.log" 2>&1
note "# pair_load rc=$? (bound ${t} s) $(elapsed)"
echo "== k bundle A3 (tree $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null))"
tail -3 "$OUT/pair_tests.log"
grep -E "^ *shape|^ *[0-9]+x[0-9]+ " "$OUT/pair_load.log" | awk '!seen[$0]++' | grep . || tail -5 "$OUT/pair_load.log"
(cd "$OUT" && tar czf "$FINAL/k_s12d_logs.tgz" -- *)
