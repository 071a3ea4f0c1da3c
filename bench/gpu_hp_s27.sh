#!/usr/bin/env bash
# Session 27, helper hp (issue 14, the host path). Ask 1: a single-weight call's device job in
# the worker grows 5-8 us at S=1 when the multi-weight calls are one backend call
# (Q6SERVE_MULTI_LAUNCH=1: o after q+k+v's launch_many, down after gate+up's), session 26's
# bundles A-C (relative to the lm-head's, S=1 o's beyond-kernel share +8-15% in every bundle).
# Ask 2: T1's device job in situ, ~40 us beyond its kernel against ~17 back to back.
# PHASE=a (bound ~95 s):
# 1. layer: bench/layer_wall.py, 3 decode layers' calls (each its own weights; q+k+v, o,
#    gate+up, down; S=1, 8; f16, F16, the worker's launch_ieee / launch_many_ieee) in one process, the multi-weight calls in
#    parts (off) / as launch_many (on) / launch_many then a tiny single call (on+s), alternated,
#    with no host work between calls and with ~150 us of it (gap), per call wall / launch /
#    kernel / the GPU's pre (launch event -> kernel start) and tail (kernel end -> after launch);
# 2. replay: the 2-layer replay (S=1, 8; multi, top-64, F16) on two workers, off /
#    Q6SERVE_MULTI_LAUNCH=1, order off,on,on,off,off,on, every direct job stamped
#    (bench/job_stamps.py: pre, x in, graph launch, record, wait, post per role);
# 3. t1: T1 (one caller, N=1 f16 ffn_down, stream), its worker's jobs stamped (ask 2).
# PHASE=b: see below; PHASE=c (bound ~70 s): stage_into vs fill_x (layer_wall OLD_FILL=1) and
# T1 stamped again on main's tree.
# (1b. wall: a small f16 y's way out in one kernel, launch.Y16_COPY 0/1, backend_wall.py
#    --out-dtype f16 on 3584x18944 / 3584x3584 N=1, 8, graph and staged, alternated; and
#    on:Y16_COPY=1 in step 1.)
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-a}
gpu_session /tmp/hp
SITE=$PWD/bench/trips_site
PP=$SITE${PYTHONPATH:+:$PYTHONPATH}
LAYERS=${LAYERS:-2}
RV=${RV:-"off:host.precision=f16 on:Q6SERVE_MULTI_LAUNCH=1,host.precision=f16"}
report() {  # the short table
  echo "# hp bundle $PHASE, tree $(tree_commit), $(elapsed)"
  echo "## layer_wall: host = wall - kernel (wall, launch, kernel, gpu_pre, gpu_tail), us"
  grep -hE "^S=|DIFFERS|bound" "$OUT/layer.log" 2>/dev/null | cut -c1-420
  echo "## backend_wall, f16 y, Y16_COPY 0/1: host p50 (wall p50, kernel p50), median of rounds"
  grep -h -A10 "^# variants" "$OUT/wall.log" 2>/dev/null | cut -c1-200
  grep -c DIFFERS "$OUT/wall.log" 2>/dev/null | sed 's/^/wall rows with y differing: /'
  echo "## replay ($LAYERS layers), step p50 and per role handler / device / kernel"
  sed -n '/^# replay A\/B/,$p' "$OUT/replay.log" 2>/dev/null | cut -c1-300
  echo "## job stamps (replay workers, T1's worker)"
  python3 bench/job_stamps.py "$OUT"/js_*.json 2>&1 | grep -v "?" | cut -c1-260
  for f in "$OUT"/t1*.log; do
    [[ -f $f ]] || continue
    grep -hE "^T1 |mean us|^# T1 stream" "$f" | tr -s ' ' | cut -c1-200
  done
  machine_summary
  steps
}
if [[ $PHASE == a ]]; then
  BOUND=${BOUND:-95}
  step layer "$(bound 30 60)" python3 bench/layer_wall.py --seqs 1,8 --steps 80 --layers 3 \
    --rounds 4 --gap-us 0,150 --variants "${LV:-off,on,on+s,on:Y16_COPY=1}" --bound 26 \
    --json "$OUT/layer.json"
  step wall "$(bound 12 46)" python3 bench/backend_wall.py --shapes 3584x18944,3584x3584 \
    --ns 1,8 --modes graph,staged --calls 120 --rounds 4 --out-dtype f16 \
    --variants "y0:Y16_COPY=0;y1:Y16_COPY=1" --json "$OUT/wall.json"
  if left 40; then
    limit=$(bound 30 16)
    PYTHONPATH=$PP Q6SERVE_JOB_STAMPS="$OUT/js_replay_{pid}.json" step replay "$limit" \
      python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" --layers "$LAYERS" \
      --variants "$RV" --order "${RORDER:-off,on,on,off}" --seqs 1,8 --seconds 1.0 \
      --warmup 0.3 --bound "$((limit - 5))" --out-dir "$OUT" --json "$OUT/replay.json"
  fi
  if left 14; then
    PYTHONPATH=$PP Q6SERVE_JOB_STAMPS="$OUT/js_t1.json" step t1 "$(bound 22 2)" \
      python3 bench/service.py --backend "${BACKEND:-cuda}" --target-report --targets T1 \
      --modes stream --weights ffn_down --seconds 1.5 --warmup 0.3 --json "$OUT/t1.json"
  fi
  report | table
elif [[ $PHASE == b ]]; then
  # 1. layer (ask 1's cause, ask 2's cut): bundle A read o / down at S=1 2.7 us (no gap) and
  #    4.6-5.3 us (150 us gap) dearer after a launch_many than after the parts' single calls,
  #    all of it in the launch's host time, and a tiny single call in between took it away;
  #    which driver call does (on+g: a one-kernel graph launched after the multi-weight call,
  #    on+G: inside its wait, on+e: an event record, on+w: a record and its synchronize,
  #    on+k: the kernel launched directly), and Y16_COPY=1 on either way (S=1). (Bundle B also
  #    ran launch.MANY_WARM=1, on+G's way in the product, at fc36764: no gain; removed.)
  # 2. the flip's A/B (ask 1): the 28-layer replay (S=1, 8; multi, top-64, F16), one worker
  #    each, Q6SERVE_MULTI_LAUNCH off / on, alternated (ORDERB), as t1's session-26 bundle C.
  BOUND=${BOUND:-95}
  step layer "$(bound 30 62)" python3 bench/layer_wall.py --seqs 1 --steps 60 --layers 3 \
    --rounds 4 --gap-us 0,150 --bound 26 --json "$OUT/layer.json" --variants \
    "${LVB:-off,on,on+s,on+g,on+G,on+e,on+w,on+k,on:Y16_COPY=1,off:Y16_COPY=1}"
  rest=$(($(bound 1000 6) - 1))
  step replay "$(bound 92 2)" python3 bench/replay_ab.py --backend "${BACKEND:-cuda}" \
    --layers "${LAYERSB:-28}" --variants "$RV" \
    --order "${ORDERB:-off,on,on,off,off,on,on,off,off,on,on,off}" --seqs "${SEQS:-1,8}" \
    --seconds 1.0 --warmup 0.4 --bound "$rest" --out-dir "$OUT" --json "$OUT/replay.json"
  {
    echo "# hp bundle b, tree $(tree_commit), $(elapsed)"
    echo "## layer_wall S=1: host = wall - kernel (wall, launch, kernel, gpu_pre, gpu_tail), us"
    grep -hE "^S=|DIFFERS|bound" "$OUT/layer.log" 2>/dev/null | cut -c1-200
    grep -hE "^# [a-z]+_[0-9]+ S=|given|FAILED" "$OUT/replay.log" 2>/dev/null | cut -c1-160
    python3 - "$OUT/replay.json" <<'PY' 2>&1 | cut -c1-300
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
    rel = [(x["o"]["device"] - x["o"]["kernel"]) / (x["lm_head"]["device"] - x["lm_head"]["kernel"])
           for x in (r["roles_p50_us"] for r in runs) if "o" in x and "lm_head" in x]
    print(f"S={s} {v} ({len(runs)} runs): step p50 median {statistics.median(steps):.2f} ms "
          f"[{', '.join(f'{x:.2f}' for x in steps)}]; worker "
          f"{statistics.median(r['step_parts_p50_ms'].get('handler', 0) for r in runs):.2f} "
          f"(device {statistics.median(r['step_parts_p50_ms'].get('device', 0) for r in runs):.2f}) ms; "
          + ", ".join(f"{role} {m['handler']:.0f}/{m['device']:.0f}/{m['kernel']:.0f}"
                      for role, m in med.items())
          + (f"; o other / lm-head other {statistics.median(rel):.3f}" if rel else ""))
PY
    machine_summary
    steps
  } | table
elif [[ $PHASE == c ]]; then
  # on main's tree (MULTI_LAUNCH and Y16_COPY on, stage_into): 1. stage_into against fill_x as
  # before (layer_wall OLD_FILL=1), both ways of the multi-weight calls, S=1 and 8, with and
  # without host work between calls; 2. T1's device job in situ again (job stamps), ask 2
  BOUND=${BOUND:-70}
  step layer "$(bound 30 32)" python3 bench/layer_wall.py --seqs 1,8 --steps 60 --layers 3 \
    --rounds 4 --gap-us 0,150 --bound 26 --json "$OUT/layer.json" \
    --variants "${LVC:-on,on:OLD_FILL=1,off,off:OLD_FILL=1}"
  if left 14; then
    PYTHONPATH=$PP Q6SERVE_JOB_STAMPS="$OUT/js_t1.json" step t1 "$(bound 30 2)" \
      python3 bench/service.py --backend "${BACKEND:-cuda}" --target-report --targets T1 \
      --modes stream --weights ffn_down --seconds 1.5 --warmup 0.3 --json "$OUT/t1.json"
  fi
  {
    echo "# hp bundle c, tree $(tree_commit), $(elapsed)"
    echo "## layer_wall: host = wall - kernel (wall, launch, kernel, gpu_pre, gpu_tail; split), us"
    grep -hE "^S=|DIFFERS|bound" "$OUT/layer.log" 2>/dev/null | cut -c1-200
    echo "## job stamps (T1's worker)"
    python3 bench/job_stamps.py "$OUT"/js_*.json 2>&1 | grep -v "?" | cut -c1-260
    grep -hE "^T1 |mean us|^# T1 stream" "$OUT/t1.log" 2>/dev/null | tr -s ' ' | cut -c1-200
    machine_summary
    steps
  } | table
fi
exit 0
