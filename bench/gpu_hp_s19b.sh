#!/usr/bin/env bash
# Session 19, helper hp, bundle B (bound 60 s): where the direct device job's host path goes in
# situ, each part of the cached call's launch stamped (bench/job_stamps.py through
# bench/trips_site: x into the pinned buffer, the graph launch, y's way out, the event record;
# the wait; what runs after), on T1 and on the 2-layer replay at S=1 and S=8, per role.
# Bundle A (tree 187a6c1, bench/gpu_hp_s19a.sh there, not landed with the spin it A/B'd):
# T1's direct job 65.7 us for a 21.8 us kernel: before the launch 9.0, the launch 21.5 (back to
# back: 8.2 + x's fill 4.2), the wait 21.4 with 21.2 of CPU (CUDA's own spin: no GIL or wake-up
# in it), after the sync 8.7; a wait spinning on cuEventQuery with the GIL held
# (Q6SERVE_WAIT_SPIN_US, dropped) changed nothing back to back (host 18.3 vs 18.5 us) nor T1
# (512 vs 447, one pair, noise). Bundle B (tree 9ef4b56): the replay's split in
# docs/SERVICE.md; its T1 run, the call's first, hit its 16 s limit on the fresh machine's
# kernel builds (now 24 s: the replay gets what is left).
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp19b
BOUND=${BOUND:-60}
SITE=$PWD/bench/trips_site
PP=$SITE${PYTHONPATH:+:$PYTHONPATH}
t1_run() {  # t1_run RUN NAME
  PYTHONPATH=$PP Q6SERVE_JOB_STAMPS=$OUT/js_t1_$1.json step "t1_$1" 24 python3 bench/service.py \
    --backend "${BACKEND:-cuda}" --target-report --targets T1 --modes stream --weights ffn_down \
    --seconds 1.2 --warmup 0.3 --json "$OUT/t1_$1.json"
}
ab_runs 20 t1_run def
if left 16; then
  limit=$(bound 30 2)
  PYTHONPATH=$PP Q6SERVE_JOB_STAMPS="$OUT/js_replay_{pid}.json" step replay "$limit" \
    python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" --variants "def:" --order def \
    --seqs 8,1 --layers "${LAYERS:-2}" --scale "${SCALE:-1}" --seconds 1.0 --warmup 0.3 \
    --bound "$((limit - 5))" --out-dir "$OUT" --json "$OUT/replay_ab.json"
fi
{
  echo "# hp bundle B, tree $(tree_commit), $(elapsed)"
  for f in "$OUT"/t1_*.log; do
    echo "$(basename "$f" .log): $(grep -E '^T1 ' "$f" | tr -s ' ' | cut -c1-150)"
    grep -E "mean us" "$f" | head -1 | tr -s ' '
    grep -E "^# T1 stream" "$f"
  done
  python3 bench/job_stamps.py "$OUT"/js_*.json 2>&1 | grep -v "?" | cut -c1-230
  grep -E "^# replay A/B|^# S=|^[a-z0-9]+_[0-9]+ " "$OUT/replay.log" 2>/dev/null | cut -c1-200
  steps
} | table
exit 0
