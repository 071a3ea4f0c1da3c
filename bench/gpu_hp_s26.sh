#!/usr/bin/env bash
# Session 26, helper hp (issue 14, the host path): is a call at precision AUTO dearer on the host
# than one at F16, and did c66f23b (launch.HOT_CALLS) make it so? Session 25's bundles E and F
# read the 28-layer replay's worker window per step 21.7 / 23.3-24.1 ms at AUTO against 18.3 /
# 15.2-16.1 at F16 (the same kernels; per call the device job +20-45 us, the handler +45-50), on
# one worker, alternated. On the host AUTO differs from F16 in one step only: api.launch_ieee asks
# the backend's plan() whether AUTO resolves to Q8_1 (it cannot on CUDA), ~0.5 us on the 2-core VM.
# This tree: Q6SERVE_HOT_CALLS (0/1, read once at import by kernels/cuda/launch.py) switches
# HOT_CALLS in a worker without a code edit; bench/backend_wall.py's PRECISION=auto|f16 variants
# call the backend through api.launch_ieee as the worker's batcher does.
# PHASE=a (bound 95 s):
# 1. wall: backend_wall.py, 4096x14336 and 14336x4096, N=1 and 64, x fresh (graph: the backend's
#    copy, a direct request's way) and staged (a batch's way), variants a1 (AUTO), f1 (F16), a0
#    and f0 (the same with HOT_CALLS=0), alternated, the order reversed every other round, 4
#    rounds; y bit-equal in every row;
# 2. replay: bench/replay_ab.py (t1's), the replay S=1, multi, top-64, LAYERS layers (10: two
#    workers' uploads and 8 runs inside the bound), worker HOT_CALLS 1 / 0 (Q6SERVE_HOT_CALLS=0)
#    x the requests at AUTO / F16, order a1,f1,a0,f0,f0,a0,f1,a1: step p50, the worker's window,
#    per call role handler / device / kernel; the workers on cores 0-7, the hosts on 8-15 (RPIN).
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-a}
gpu_session /tmp/hp
SHAPES=${SHAPES:-4096x14336,14336x4096}
LAYERS=${LAYERS:-10}
V=${V:-"a1:PRECISION=auto;f1:PRECISION=f16;a0:PRECISION=auto,HOT_CALLS=0;f0:PRECISION=f16,HOT_CALLS=0"}
RV=${RV:-"a1: f1:host.precision=f16 a0:Q6SERVE_HOT_CALLS=0 f0:Q6SERVE_HOT_CALLS=0,host.precision=f16"}
RORDER=${RORDER:-a1,f1,a0,f0,f0,a0,f1,a1}
# the workers on cores 0-7 (8: the loop still busy-polls, SPIN_MIN_CPUS), every replay host on
# 8-15 (replay_ab --pin): a host process never shares a core with the worker it measures
# (session 25's bundle E read AUTO 40% dearer in two of two alternated pairs, unpinned;
# whether a host's placement did that is not known)
RPIN=${RPIN:-0-7:8-15}
report() {  # the short table
  echo "# hp bundle $PHASE, tree $(tree_commit), $(elapsed); wall variants: $V; replay: $RV"
  echo "## backend wall (host p50 (wall p50, kernel p50), median of the rounds, us)"
  grep -h -A12 "^# variants" "$OUT/wall.log" 2>/dev/null | cut -c1-240
  cat "$OUT"/wall.log 2>/dev/null | grep -c DIFFERS | sed 's/^/rows with y differing: /'
  echo "## replay (S=1, multi, $LAYERS layers)"
  grep -hE "given|skipped|FAILED|Q6SERVE_ var" "$OUT/replay.log" 2>/dev/null | cut -c1-240
  sed -n '/^# replay A\/B/,$p' "$OUT/replay.log" 2>/dev/null | cut -c1-400
  echo "## replay per call role, median of the runs' p50 (us): handler / device / kernel"
  python3 - "$OUT/replay.json" <<'PY' 2>&1 | cut -c1-400
import json, statistics, sys
try:
    doc = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no replay.json ({type(e).__name__})")
for v in doc["variants"]:
    runs = [r for r in doc["runs"] if r["variant"] == v]
    roles = {}
    for r in runs:
        for role, f in r.get("roles_p50_us", {}).items():
            for k in ("handler", "device", "kernel"):
                roles.setdefault(role, {}).setdefault(k, []).append(f.get(k, float("nan")))
    med = {role: {k: statistics.median(x) for k, x in f.items()} for role, f in roles.items()}
    print(f"{v} ({len(runs)} runs): " + ", ".join(
        f"{role} {m['handler']:.0f}/{m['device']:.0f}/{m['kernel']:.0f}" for role, m in med.items()))
PY
  machine_summary
  steps
}
if [[ $PHASE == a ]]; then
  BOUND=${BOUND:-95}
  step wall "$(bound 28 40)" python3 bench/backend_wall.py --shapes "$SHAPES" --ns 1,64 \
    --modes graph,staged --calls 120 --rounds 4 --json "$OUT/wall.json" --variants "$V"
  # replay_ab's own bound: no run starts that would end past it (4 s kept for the table)
  rest=$(($(bound 1000 4) - 1))
  step replay "$(bound 70 2)" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
    --layers "$LAYERS" --variants "$RV" --order "$RORDER" --seqs 1 --seconds 1.0 \
    --warmup 0.4 --pin "$RPIN" --bound "$rest" --out-dir "$OUT" --json "$OUT/replay.json"
  report | table
elif [[ $PHASE == b ]]; then
  # the fix (branch hp-s26-autofix: api.launch_ieee asks plan() only for a precision outside
  # Backend.no_q8_1, which holds AUTO on CUDA): wall a1 (AUTO), ap (AUTO asking plan, as
  # before: ASK_PLAN=1), f1 (F16); replay a (AUTO) / f (F16) on one worker, LAYERS layers
  BOUND=${BOUND:-95}
  V=${VB:-"a1:PRECISION=auto;ap:PRECISION=auto,ASK_PLAN=1;f1:PRECISION=f16"}
  RV=${RVB:-"a: f:host.precision=f16"}
  RORDER=${RORDERB:-a,f,f,a,a,f}
  step wall "$(bound 26 45)" python3 bench/backend_wall.py --shapes "$SHAPES" --ns 1,64 \
    --modes graph,staged --calls 150 --rounds 4 --json "$OUT/wall.json" --variants "$V"
  rest=$(($(bound 1000 4) - 1))
  step replay "$(bound 70 2)" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
    --layers "$LAYERS" --variants "$RV" --order "$RORDER" --seqs "${SEQS:-1}" --seconds 1.0 \
    --warmup 0.4 --pin "$RPIN" --bound "$rest" --out-dir "$OUT" --json "$OUT/replay.json"
  report | table
fi
exit 0
