#!/usr/bin/env bash
# Session 29, helper hp (issue 14, the device job of a call).
# PHASE=a (bound ~100 s):
# 1. cold: is T1 slower on a worker that compiled its kernels (the closing check's first worker,
#    241 us against 179 on a later one)? bench/hp_cold_t1.py: a spare worker compiles into one
#    CuPy cache dir; then four workers at once, warm1/warm2 on that dir (they load the modules),
#    cold1/cold2 each on a fresh dir (they compile, NVRTC), warmed warm1 first; T1's load
#    (N=1 f16 ffn_down, stream) alternated over them (4 runs a class), /proc of each worker
#    (threads, heap, huge pages, each thread's CPU while idle).
# 2. layer: the in-situ enqueue cost against a CPU held out of deep idle: bench/layer_wall.py
#    S=1, 8 (3 layers, launch_many on) with the replay's gaps (150 us of host work, then 300 us
#    asleep, as the worker's loop idles while its reply and the next request travel; and the
#    work alone, no sleep: an A/A of the hold), on vs on:DMA_LAT=1 (/dev/cpu_dma_latency held
#    at 0 while that variant runs), alternated per round; the cpuidle driver and states printed.
# PHASE=b (bound ~100 s; bundle A: no cpuidle driver on the H200 VM, so the hold has nothing
#    to act on; a 300 us sleep between calls cost +10-31 us a call):
# 1. layer: bench/layer_wall.py S=1, 8 (3 layers, 150 us of host work before each call), four
#    variants alternated per round: spin (300 us busy-polling an empty selector after the work,
#    as the worker's loop does between requests), sleep (300 us asleep), sleep+dma (asleep,
#    /dev/cpu_dma_latency held), spin with MANY_Y_GRAPH=0 (a multi-weight call's large y copied
#    by a copy enqueued after its graph, main's way; this tree: by its own graph, one driver
#    call a call instead of two);
# 2. replay: MANY_Y_GRAPH on (def) / off (alt) on ONE worker's 28-layer replay (S=1, 8; multi,
#    top-64, f16) switched between runs by a signal (bench/hp_toggle_ab.py), alternated.
#    (Bundle B, tree 9a3d402: MANY_Y_GRAPH's graph was captured off the backend's stream from
#    the cached call, so its kernels ran outside it: y differed, kernel times ~3 us. Fixed.)
# PHASE=c (bound ~60 s, bundle C): MANY_Y_GRAPH judged again with the fix: layer_wall S=1, 8
#    (150 us work + 300 us spin before each call, as the worker's loop) on / off alternated per
#    round, y compared bit for bit; then the one-worker replay toggle, S=8, while the bound allows.
set -uo pipefail
# shellcheck source=bench/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
PHASE=${PHASE:-a}
gpu_session /tmp/hp
SITE=$PWD/bench/hp_site
PP=$SITE${PYTHONPATH:+:$PYTHONPATH}
LAYERS=${LAYERS:-28}
cpuidle() {  # the cpuidle driver, governor and cpu0's states (name latency usage time)
  local d=/sys/devices/system/cpu/cpuidle
  echo "# cpuidle $1: driver $(cat $d/current_driver 2>/dev/null || echo -)," \
    "governor $(cat $d/current_governor_ro $d/current_governor 2>/dev/null | head -1 || echo -)," \
    "dma_latency $( [[ -r /dev/cpu_dma_latency ]] && echo readable || echo no)," \
    "cpu0: $(for s in /sys/devices/system/cpu/cpu0/cpuidle/state*; do [[ -d $s ]] &&
      printf '%s/%s/%s/%s ' "$(cat "$s/name")" "$(cat "$s/latency")" "$(cat "$s/usage")" \
        "$(cat "$s/time")"; done)"
  grep -h . /sys/module/haltpoll/parameters/* 2>/dev/null | tr '\n' ' ' | sed 's/^/# haltpoll /'
  echo
}
if [[ $PHASE == a ]]; then
  BOUND=${BOUND:-100}
  cpuidle start >"$OUT/cpuidle.log"
  step cold "$(bound 68 30)" python3 bench/hp_cold_t1.py --backend "${BACKEND:-cuda}" \
    --row-scale "${ROW_SCALE:-1}" --workers "${WORKERS:-warm1,cold1,warm2,cold2}" \
    --order "${ORDER:-cold1,warm1,warm2,cold2,cold2,warm2,warm1,cold1}" --seconds 1.0 \
    --warmup 0.3 --bound "$(($(bound 68 30) - 2))" --root /tmp/hp_kc --out-dir "$OUT" \
    --json "$OUT/cold.json"
  lb=$(($(bound 1000 4) - 1))
  step layer "$((lb + 1))" python3 bench/layer_wall.py --seqs 1,8 --steps 40 --layers 3 \
    --rounds 4 --gap-us "${GAPS:-150+300,150}" --variants "${LV:-on,on:DMA_LAT=1}" \
    --bound "$((lb > 12 ? lb - 10 : 1))" --json "$OUT/layer.json"
  cpuidle end >>"$OUT/cpuidle.log"
  {
    echo "# hp bundle a, tree $(tree_commit), $(elapsed)"
    echo "## cold/warm kernel cache: T1 runs and classes (p50, kernel, p50 - kernel; parts)"
    grep -hE "^# (spare|warm|cold)[0-9]*\*?[:_ ]|^(cold|warm)[0-9]+_|FAILED|skipped" \
      "$OUT/cold.log" 2>/dev/null | cut -c1-300
    echo "## layer_wall: host = wall - kernel (wall, launch, kernel, gpu_pre, gpu_tail), us"
    grep -hE "^S=|DIFFERS|bound|DMA_LAT" "$OUT/layer.log" 2>/dev/null | cut -c1-200
    cut -c1-400 "$OUT/cpuidle.log"
    machine_summary
    steps
  } | table
elif [[ $PHASE == b ]]; then
  BOUND=${BOUND:-100}
  cpuidle start >"$OUT/cpuidle.log"
  SP=on:SPIN_US=300
  step layer "$(bound 34 40)" python3 bench/layer_wall.py --seqs 1,8 --steps 30 --layers 3 \
    --rounds 4 --gap-us 150 --bound "$(($(bound 34 40) - 4))" --json "$OUT/layer.json" \
    --variants "${LVB:-$SP,on:SLEEP_US=300,on:SLEEP_US=300+DMA_LAT=1,$SP+MANY_Y_GRAPH=0}"
  rest=$(($(bound 1000 4) - 1))
  PYTHONPATH=$PP step replay "$(bound 96 2)" python3 bench/hp_toggle_ab.py \
    --backend "${BACKEND:-cuda}" --layers "$LAYERS" --alt "${ALT:-MANY_Y_GRAPH=0}" \
    --order "${ORDERB:-def,alt,alt,def,def,alt,alt,def,def,alt,alt,def}" --seqs "${SEQS:-8,1}" \
    --seconds 1.0 --warmup 0.4 --bound "$rest" --out-dir "$OUT" --json "$OUT/replay.json"
  cpuidle end >>"$OUT/cpuidle.log"
  {
    echo "# hp bundle b, tree $(tree_commit), $(elapsed)"
    echo "## layer_wall: host = wall - kernel (wall, launch, kernel, gpu_pre, gpu_tail), us"
    grep -hE "^S=|DIFFERS|bound|DMA_LAT" "$OUT/layer.log" 2>/dev/null | cut -c1-200
    echo "## the replay on one worker, def (MANY_Y_GRAPH=1) / alt (${ALT:-MANY_Y_GRAPH=0})"
    grep -hE "^# [a-z]+_[0-9]+ S=|given|FAILED|^S=|toggle|hp_site" "$OUT/replay.log" \
      2>/dev/null | cut -c1-330
    cut -c1-300 "$OUT/cpuidle.log"
    machine_summary
    steps
  } | table
elif [[ $PHASE == c ]]; then
  BOUND=${BOUND:-60}
  SP=on:SPIN_US=300
  step layer "$(bound 22 36)" python3 bench/layer_wall.py --seqs 1,8 --steps 30 --layers 3 \
    --rounds 4 --gap-us 150 --bound "$(($(bound 22 36) - 4))" --json "$OUT/layer.json" \
    --variants "${LVC:-$SP,$SP+MANY_Y_GRAPH=0}"
  rest=$(($(bound 1000 3) - 1))
  PYTHONPATH=$PP step replay "$(bound 60 2)" python3 bench/hp_toggle_ab.py \
    --backend "${BACKEND:-cuda}" --layers "$LAYERS" --alt "${ALT:-MANY_Y_GRAPH=0}" \
    --order "${ORDERC:-def,alt,alt,def,def,alt,alt,def,def,alt,alt,def}" --seqs "${SEQS:-8}" \
    --seconds 1.0 --warmup 0.4 --bound "$rest" --out-dir "$OUT" --json "$OUT/replay.json"
  {
    echo "# hp bundle c, tree $(tree_commit), $(elapsed)"
    echo "## layer_wall: host = wall - kernel (wall, launch, kernel, gpu_pre, gpu_tail), us"
    grep -hE "^S=|DIFFERS|bound" "$OUT/layer.log" 2>/dev/null | cut -c1-200
    echo "## the replay on one worker, def (MANY_Y_GRAPH=1) / alt (${ALT:-MANY_Y_GRAPH=0})"
    grep -hE "^# [a-z]+_[0-9]+ S=|given|FAILED|^S=|toggle|hp_site" "$OUT/replay.log" \
      2>/dev/null | cut -c1-330
    machine_summary
    steps
  } | table
fi
exit 0
