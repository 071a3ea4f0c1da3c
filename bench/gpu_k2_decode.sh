#!/usr/bin/env bash
# One device call (issue 16, session 8, helper k2): the K-slice tiles' GPU tests on this tree,
# then on one machine: AUTO of the tree at $BASE (main) and of this one, and the K-slice/ring
# launch shapes at N = 16/32 of $BASE, this tree and the decode-floor probe tree at $FLOOR (a
# commit that replaces the Q6_K decode by one LOP3 + one HFMA2 per f16x2: wrong values, timing
# only; never landed) - or another variant tree: OTHER=dir OTHER_TAG=name. Run from this tree's
# root; logs and JSON under $OUT.
#   BASE=base FLOOR=floor bench/gpu_k2_decode.sh
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
BASE=${BASE:-base}
OTHER=${OTHER:-${FLOOR:-floor}}
TAG=${OTHER_TAG:-floor}
AUTO_ARGS=${AUTO_ARGS:-"--shapes 4096x14336,14336x4096,18944x3584,3584x18944,152064x3584 --ns 1,8,16,32,64 --paths auto --dtypes f16 --iters 20"}
VAR_ARGS=${VAR_ARGS:-"--shapes 4096x14336,3584x18944,152064x3584 --ns 16,32 --paths auto --variants --only nt2.ks.w16,nt2.ring.w16,nt4.ks.w12,nt4.ring.w16 --dtypes f16 --no-torch --iters 20"}
KSTEST_TIMEOUT=${KSTEST_TIMEOUT:-80} bench/gpu_run.sh kstest
ks_rc=$?
export PYTHONPATH=/tmp/site
here=$PWD
bench_in() {  # bench_in DIR TAG ARGS...: bench/kernels.py of the tree in DIR -> $OUT/TAG.{json,log}
  local dir=$1 tag=$2
  shift 2
  (cd "$dir" && python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/install_$tag.log" 2>&1 \
    && timeout "${BENCH_TIMEOUT:-90}" python3 bench/kernels.py "$@" --json "$OUT/$tag.json" >"$OUT/$tag.log" 2>&1)
  echo "# $tag rc=$?"
}
# shellcheck disable=SC2086
bench_in "$BASE" auto_base $AUTO_ARGS --no-torch
# shellcheck disable=SC2086
bench_in "$here" auto_this $AUTO_ARGS
# shellcheck disable=SC2086
bench_in "$BASE" var_base $VAR_ARGS
# shellcheck disable=SC2086
bench_in "$OTHER" "var_$TAG" $VAR_ARGS
# shellcheck disable=SC2086
bench_in "$here" var_this $VAR_ARGS
cd "$here" || exit 1
{
  python3 bench/kernels_ab.py "$OUT/auto_base.json" "$OUT/auto_this.json" --label-old base --label-new this
  python3 bench/kernels_ab.py "$OUT/var_base.json" "$OUT/var_this.json" --label-old base --label-new this --match mma_f16.
  python3 bench/kernels_ab.py "$OUT/var_this.json" "$OUT/var_$TAG.json" --label-old this --label-new "$TAG" --match mma_f16.
  grep -h "torch f16" "$OUT/auto_this.log"
} 2>&1 | tee "$OUT/ab.txt"
echo "# kstest rc=$ks_rc"
# the device tool returns 8 files at most: every log and JSON also in one archive
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
