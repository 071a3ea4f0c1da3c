#!/usr/bin/env bash
# Session 28, helper hp (issue 14, the device job of a call in the replay). The 28-layer
# replay's device job per call (closing check s27: S=8 ~104 us a call for ~30 us of kernel,
# S=1 ~71) split into its parts on the H200 as the replay drives it, and the largest part cut.
# PHASE=a (bound ~98 s):
# 1. layer: bench/layer_wall.py S=1, 8 (3 layers, launch_many on, with and without ~150 us of
#    host work between calls), alternated: on (main), on:NT_FILL_MIN=0 (x's fill into the
#    pinned staging by NumPy at every size; main: non-temporal stores from 256 KiB, down's
#    303 KB x at S=8), on:SMALL_Y=98304 (an f16 y up to 96 KiB downloaded by the graph itself:
#    q+k+v's 73.7 KB y at S=8 and gate+up's 75.8 KB at S=1, main: a pinned block and a DMA
#    enqueued per call after the graph launch);
# 2. replay: the 28-layer replay (S=1, 8; multi, top-64, F16) on three workers, each with
#    every direct job stamped (bench/job_stamps.py: pre, x in, graph launch, y out, record,
#    wait, post per call kind): def (main 1e0f9dc's code), nt0 (HP_SET_NT_FILL_MIN=0 through
#    bench/hp_site), sy (HP_SET_SMALL_Y=98304), alternated (RORDER).
# PHASE=b (bound ~98 s): bundle A's cut judged on one worker switched between runs (below).
# PHASE=c (bound ~70 s, tree 4c2311a): the multi-weight calls' identity lookup (launch.HOT_MANY,
# lost, reverted) in layer_wall and on one worker's replay, switched between runs. PHASE=d
# (bound ~40 s): the landed tree's device job stamped, and a large y's pinned block probed.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-a}
gpu_session /tmp/hp
SITE=$PWD/bench/hp_site
PP=$SITE${PYTHONPATH:+:$PYTHONPATH}
LAYERS=${LAYERS:-28}
JS="Q6SERVE_JOB_STAMPS=$OUT/js_{pid}.json"
replay_summary() {  # replay.json: per (S, variant) step p50s and the worker's per-role medians
  python3 - "$OUT/replay.json" <<'PY' 2>&1 | cut -c1-330
import json, statistics, sys
try:
    doc = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no replay.json ({type(e).__name__})")
by = {}
for r in doc["runs"]:
    by.setdefault((r["seqs"], r["variant"]), []).append(r)
for (s, v), runs in sorted(by.items()):
    steps = [r["step_p50_ms"] for r in runs]
    roles = {}
    for r in runs:
        for role, f in r.get("roles_p50_us", {}).items():
            roles.setdefault(role, []).append(f)
    med = {role: {k: statistics.median(f[k] for f in fs) for k in ("handler", "device", "kernel")}
           for role, fs in roles.items()}
    part = lambda k: statistics.median(r["step_parts_p50_ms"].get(k, 0) for r in runs)
    print(f"S={s} {v} ({len(runs)} runs): step p50 median {statistics.median(steps):.2f} ms "
          f"[{', '.join(f'{x:.2f}' for x in steps)}]; worker {part('handler'):.2f} "
          f"(device {part('device'):.2f}) ms; per role handler/device/kernel us: "
          + ", ".join(f"{role} {m['handler']:.0f}/{m['device']:.0f}/{m['kernel']:.0f}"
                      for role, m in med.items()))
PY
}
if [[ $PHASE == a ]]; then
  BOUND=${BOUND:-98}
  F=host.precision=f16
  RVA="def:$JS,$F nt0:$JS,HP_SET_NT_FILL_MIN=0,$F sy:$JS,HP_SET_SMALL_Y=98304,$F"
  step layer "$(bound 20 72)" python3 bench/layer_wall.py --seqs 1,8 --steps 40 --layers 3 \
    --rounds 3 --gap-us 0,150 --variants "${LV:-on,on:NT_FILL_MIN=0,on:SMALL_Y=98304}" \
    --bound 17 --json "$OUT/layer.json"
  rest=$(($(bound 1000 4) - 1))
  PYTHONPATH=$PP step replay "$(bound 90 2)" python3 bench/replay_ab.py \
    --backend "${BACKEND:-cuda}" --layers "$LAYERS" \
    --variants "${RV:-$RVA}" \
    --order "${RORDER:-def,nt0,sy,sy,nt0,def,def,nt0,sy}" --seqs "${SEQS:-1,8}" \
    --seconds 1.0 --warmup 0.4 --bound "$rest" --out-dir "$OUT" --json "$OUT/replay.json"
  {
    echo "# hp bundle a, tree $(tree_commit), $(elapsed)"
    echo "## layer_wall: host = wall - kernel (wall, launch, kernel, gpu_pre, gpu_tail), us"
    grep -hE "^S=|DIFFERS|bound" "$OUT/layer.log" 2>/dev/null | cut -c1-200
    echo "## replay ($LAYERS layers): step p50, worker window, per role"
    grep -hE "^# [a-z0-9]+_[0-9]+ S=|given|FAILED" "$OUT/replay.log" 2>/dev/null | cut -c1-160
    grep -h "hp_site" "$OUT"/*.log 2>/dev/null | sort -u
    replay_summary
    echo "## job stamps per worker (the hp_site lines above name the pids of nt0 and sy)"
    python3 bench/job_stamps.py "$OUT"/js_*.json 2>&1 | grep -v "?" | cut -c1-260
    machine_summary
    steps
  } | table
elif [[ $PHASE == b ]]; then
  # the judge of bundle A's cut (NT_FILL_MIN 1 MiB, this tree's default) on ONE worker: the
  # 28-layer replay (S=1, 8; multi, top-64, F16), the worker switched between runs by a signal
  # (bench/hp_toggle_ab.py: def = this tree, alt = HP_ALT_NT_FILL_MIN=262144, main 1e0f9dc's
  # value), alternated; no stamps. (Bundle A's three workers differed by 10-15% in call kinds
  # no variant touched, so a one-worker-per-variant A/B reads the workers.) S=1 has no x of
  # 256 KiB or more: an A/A of the switch.
  BOUND=${BOUND:-98}
  rest=$(($(bound 1000 4) - 1))
  PYTHONPATH=$PP step replay "$(bound 96 2)" python3 bench/hp_toggle_ab.py \
    --backend "${BACKEND:-cuda}" --layers "$LAYERS" --alt "${ALT:-NT_FILL_MIN=262144}" \
    --order "${ORDERB:-def,alt,alt,def,def,alt,alt,def,def,alt,alt,def}" --seqs "${SEQS:-1,8}" \
    --seconds 1.0 --warmup 0.4 --bound "$rest" --out-dir "$OUT" --json "$OUT/replay.json"
  {
    echo "# hp bundle b, tree $(tree_commit), $(elapsed)"
    echo "## the replay on one worker, def (this tree) / alt (NT_FILL_MIN=262144)"
    grep -hE "^# [a-z]+_[0-9]+ S=|given|FAILED|^S=|toggle" "$OUT/replay.log" 2>/dev/null \
      | cut -c1-330
    grep -h "hp_site" "$OUT"/*.log 2>/dev/null | sort -u
    machine_summary
    steps
  } | table
elif [[ $PHASE == c ]]; then
  # (runs at tree 4c2311a only: launch.HOT_MANY lost in bundle C and was reverted after it)
  # the multi-weight calls' identity lookup (launch.HOT_MANY, this tree) against the keyed
  # one (HOT_MANY=0): 1. bench/layer_wall.py S=1, 8 in one process, alternated; 2. the 28-layer
  # replay on ONE worker switched between runs (bench/hp_toggle_ab.py, alt HOT_MANY=0).
  BOUND=${BOUND:-70}
  step layer "$(bound 16 52)" python3 bench/layer_wall.py --seqs 1,8 --steps 40 --layers 3 \
    --rounds 3 --gap-us 0,150 --variants "${LVC:-on,on:HOT_MANY=0}" --bound 13 \
    --json "$OUT/layer.json"
  rest=$(($(bound 1000 4) - 1))
  PYTHONPATH=$PP step replay "$(bound 70 2)" python3 bench/hp_toggle_ab.py \
    --backend "${BACKEND:-cuda}" --layers "$LAYERS" --alt "${ALTC:-HOT_MANY=0}" \
    --order "${ORDERC:-def,alt,alt,def,def,alt,alt,def}" --seqs "${SEQS:-1,8}" \
    --seconds 1.0 --warmup 0.4 --bound "$rest" --out-dir "$OUT" --json "$OUT/replay.json"
  {
    echo "# hp bundle c, tree $(tree_commit), $(elapsed)"
    echo "## layer_wall: host = wall - kernel (wall, launch, kernel[, gpu_pre, gpu_tail]), us"
    grep -hE "^S=|DIFFERS|bound" "$OUT/layer.log" 2>/dev/null | cut -c1-200
    echo "## the replay on one worker, def (this tree) / alt (HOT_MANY=0)"
    grep -hE "^# [a-z]+_[0-9]+ S=|given|FAILED|^S=|toggle" "$OUT/replay.log" 2>/dev/null \
      | cut -c1-330
    grep -h "hp_site" "$OUT"/*.log 2>/dev/null | sort -u
    machine_summary
    steps
  } | table
elif [[ $PHASE == d ]]; then
  # the landed tree's device job in its parts (NT_FILL_MIN 1 MiB on main since 0567bd5): one
  # worker, the 28-layer replay once (S=1, 8), every direct job stamped, and a large y's
  # pinned block probed (HP_YB_PROBE: kept blocks reused vs CuPy's pool per call: is a
  # multi-weight call's "y out", 22 us in situ, the pool's fallback?)
  BOUND=${BOUND:-40}
  rest=$(($(bound 1000 3) - 1))
  Q6SERVE_JOB_STAMPS="$OUT/js_{pid}.json" HP_YB_PROBE="$OUT/yb_{pid}.json" PYTHONPATH=$PP \
    step replay "$(bound 38 1)" python3 bench/hp_toggle_ab.py --backend "${BACKEND:-cuda}" \
    --layers "$LAYERS" --alt NT_FILL_MIN=262144 --order def --seqs "${SEQS:-1,8}" \
    --seconds 1.0 --warmup 0.4 --bound "$rest" --out-dir "$OUT" --json "$OUT/replay.json"
  {
    echo "# hp bundle d, tree $(tree_commit), $(elapsed)"
    grep -hE "^# [a-z]+_[0-9]+ S=|given|FAILED|^S=" "$OUT/replay.log" 2>/dev/null | cut -c1-330
    python3 bench/job_stamps.py "$OUT"/js_*.json 2>&1 | grep -v "?" | grep -v handler \
      | cut -c1-200
    for f in "$OUT"/yb_*.json; do [[ -f $f ]] && echo "y_block $(basename "$f"): $(cat "$f")"; done
    machine_summary
    steps
  } | table
fi
exit 0
