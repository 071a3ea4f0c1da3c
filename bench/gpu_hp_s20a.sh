#!/usr/bin/env bash
# Session 20, helper hp, bundle A (bound 100 s), issue 14 goals 1, 2, 4:
# 0. The large y's kept pinned blocks (kernels/cuda/launch.py Y_BLOCKS, Workspace.y_block) back
#    to back against CuPy's pool per call (Y_BLOCKS=0, as before), alternated per round:
#    bench/backend_wall.py staged + graph on 18944x3584 N=8 (606 KB of f32 y) and the host wall
#    target's 4096x14336 / 14336x4096 N=64 (1 / 3.7 MB), with the bus floor.
# 1. The same on multi-weight calls (--many qkv,gateup, f16 y, N=1,8: parts / pipe / many).
# 2. The 2-layer replay at S=8 and S=1 (bench/replay_ab.py), every direct job stamped
#    (bench/job_stamps.py): def (blocks on), one (Q6SERVE_MULTI_LAUNCH=1: a multi-weight call's
#    parts as one launch_many), old (Q6SERVE_JOB_Y_BLOCKS=0), alternated def,one,old,one,def.
# 3. tests/service/test_launch_split.py's GPU tests, if time is left.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_session /tmp/hp20a
BOUND=${BOUND:-100}
SITE=$PWD/bench/trips_site
PP=$SITE${PYTHONPATH:+:$PYTHONPATH}
step wall 22 python3 bench/backend_wall.py --shapes 18944x3584,4096x14336,14336x4096 \
  --ns 8,64 --modes staged,graph --calls 200 --rounds 3 --floor --json "$OUT/wall.json" \
  --variants "def;old:Y_BLOCKS=0"
step many 16 python3 bench/backend_wall.py --many qkv,gateup --ns 1,8 --many-out f16 \
  --calls 200 --rounds 3 --json "$OUT/many.json" --variants "def;old:Y_BLOCKS=0"
if left 25; then
  limit=$(bound 60 4)
  PYTHONPATH=$PP Q6SERVE_JOB_STAMPS="$OUT/js_replay_{pid}.json" step replay "$limit" \
    python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
    --variants "def: one:Q6SERVE_MULTI_LAUNCH=1 old:Q6SERVE_JOB_Y_BLOCKS=0" \
    --order def,one,old,one,def --seqs 8,1 --layers "${LAYERS:-2}" --scale "${SCALE:-1}" \
    --seconds 1.0 --warmup 0.3 --bound "$((limit - 6))" --out-dir "$OUT" \
    --json "$OUT/replay_ab.json"
fi
# the launcher's GPU tests (y's bit-identical ways out, the split calls) if time is left
left 12 && step tests 12 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
  tests/service/test_launch_split.py
{
  echo "# hp bundle A, tree $(tree_commit), $(elapsed)"
  grep -A14 "^# variants" "$OUT/wall.log" | cut -c1-170
  grep -E "floor|h2d|d2h" "$OUT/wall.log" | head -8 | cut -c1-170
  grep -E "^#|many|parts|pipe" "$OUT/many.log" | tail -24 | cut -c1-170
  python3 bench/job_stamps.py "$OUT"/js_*.json 2>&1 | grep -v "?" | cut -c1-230
  grep -E "^# replay A/B|^# S=|^[a-z0-9]+_[0-9]+ " "$OUT/replay.log" 2>/dev/null | cut -c1-200
  tail -1 "$OUT/tests.log" 2>/dev/null
  steps
} | table
exit 0
