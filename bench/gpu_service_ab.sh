#!/usr/bin/env bash
# A/B of the service on one GPU machine in one session (issue 14): a base tree ($BASE, e.g. a
# `git archive` of an older main) and this tree, each installed in turn and run with the same
# commands: a T1-shaped run (one caller, N=1, f16, ffn_down, MatmulStream: the plain replay mode
# both trees have) and the 7B decode replay at S=1 with and without multi-weight calls (f32 y,
# as an older replay asks), this tree again with the GIL hand-off yield off
# (Q6SERVE_HANDOFF_YIELD=0); then this tree's lm-head target (N=64, 8 callers, top-64) at
# --max-batch-rows 256 and 512 (several callers' rows in one launch). $OUT gets the archive of
# every log and JSON, and summary.txt (printed last). ~130 s after the install.
#   BASE=../fastbase bench/gpu_service_ab.sh          env: SECONDS_PER_RUN (2)
set -uo pipefail
FINAL=${OUT:-$PWD/out}
OUT=/tmp/abrun
rm -rf "$OUT" /tmp/abrun.installed
mkdir -p "$FINAL" "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
BASE=${BASE:?set BASE to the base tree}
HERE=$PWD
bench/gpu_run.sh none >"$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
[[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site
S=${SECONDS_PER_RUN:-2}
tree() {  # label dir [replay args]: install the tree, run T1-shaped and the S=1 replay
  local label=$1 dir=$2
  shift 2
  if [[ $(cat /tmp/abrun.installed 2>/dev/null) != "$dir" ]]; then
    python3 -m pip install -q --no-deps --no-build-isolation -e "$dir" \
      >"$OUT/$label.install.log" 2>&1 || { echo "# $label install failed"; return; }
    echo "$dir" >/tmp/abrun.installed
  fi
  (cd "$dir" && timeout 40 python3 bench/service.py --backend cuda --weights ffn_down \
    --hosts 1 --seqs 1 --batching on --mode stream --seconds "$S" --warmup 0.3 \
    --json "$OUT/${label}_t1.json" >"$OUT/${label}_t1.log" 2>&1)
  echo "# $label t1 rc=$? ($(($(date +%s) - T0)) s)"
  (cd "$dir" && timeout 60 python3 bench/service.py --backend cuda --replay --replay-seqs 1 \
    --no-replay-floor --seconds "$S" --warmup 0.3 "$@" \
    --json "$OUT/${label}_replay.json" >"$OUT/${label}_replay.log" 2>&1)
  echo "# $label replay rc=$? ($(($(date +%s) - T0)) s)"
}
tree base "$BASE"
tree now "$HERE" --replay-out f32
Q6SERVE_HANDOFF_YIELD=0 tree nowy0 "$HERE" --replay-out f32
for R in 256 512; do
  timeout 35 python3 bench/service.py --backend cuda --lm-head --mode stream --seconds "$S" \
    --warmup 0.3 --max-batch-rows "$R" --json "$OUT/lm$R.json" >"$OUT/lm$R.log" 2>&1
  echo "# lm-head max-batch-rows $R rc=$? ($(($(date +%s) - T0)) s)"
done
python3 bench/service_summary.py ab "$OUT" >"$OUT/summary.txt"
tar czf "$FINAL/ab_run.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
echo "# total $(($(date +%s) - T0)) s"
cat "$OUT/summary.txt"
