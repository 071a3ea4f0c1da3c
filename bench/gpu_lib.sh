# shellcheck shell=bash
# The pieces every bench/gpu_*.sh device script shares (sourced). A device call runs one command
# on a fresh machine and brings back at most 8 files from $OUT, so a script is:
#
#   source "$(dirname "$0")/gpu_lib.sh"
#   gpu_session /tmp/NAME                 # install; logs in $OUT=/tmp/NAME, results in $FINAL
#   BOUND=${BOUND:-100}                   # the bundle's bound, s from the start (unset: none)
#   step NAME LIMIT CMD...                # one command, cut to LIMIT s and to the bound
#   step_if NEED NAME LIMIT CMD...        # the same where NEED s are still left in the bound
#   ab_runs NEED FN "a" "b:Q6SERVE_X=1" "b:Q6SERVE_X=1" "a"   # alternated variants
#   { grep ... "$OUT"/*.log; } | table    # the short table, printed last; every log archived
#
# DRY_RUN=1 rehearses a script on a CPU machine: no install, a stand-in nvidia-smi, DIR made under
# $FINAL/dry (a rehearsal never clears a real run's folder); the commands themselves run (pass
# BACKEND=numpy and small shapes where the script takes them). tests/bench/test_gpu_scripts.py
# rehearses every bench/gpu_*.sh that way with the timed commands stood in for.

# gpu_session DIR: FINAL = the folder the device tool brings back ($OUT as given, or ./out), OUT =
# DIR (cleared: every log lands there, and `archive` packs it into $FINAL/NAME.tgz, NAME = DIR's
# last part); installs the carried wheels and the project (bench/gpu_run.sh none; with
# SKIP_INSTALL=1 it only points PYTHONPATH at what an earlier script of the same call
# installed), prints the tree's commit and starts the clock that `elapsed` and `bound` read.
gpu_session() {
  FINAL=${OUT:-$PWD/out}
  OUT=$1
  [[ -n ${DRY_RUN:-} ]] && OUT=$FINAL/dry$1
  ARCHIVE=${1##*/}
  STEPS=()
  rm -rf "$OUT"
  mkdir -p "$FINAL" "$OUT"
  export PYTHONUNBUFFERED=1
  T0=$(date +%s)
  if [[ -n ${DRY_RUN:-} ]]; then  # a CPU rehearsal of a script (BACKEND=numpy): no install
    nvidia-smi() { echo "no GPU (dry run)"; }
    return 0
  fi
  machine_watch
  bench/gpu_run.sh none >"$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
  [[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site
  head -3 "$OUT/setup.log"
  echo "tree $(tree_commit)"
}
elapsed() { echo "$(($(date +%s) - T0)) s"; }

# machine_watch: samples the machine every second into $OUT/machine.log while the script runs
# (it ends within a second of the script's shell, or after WATCH_S, default 900 s): the
# busy, iowait and steal shares of all cores since the last sample (/proc/stat; steal: time
# the hypervisor gave this VM's CPUs to someone else), the 1-minute load, the cores' MHz
# (mean, min, max of /proc/cpuinfo) and the GPU's SM clock; every 10 s the processes using
# most CPU. Why: session 21's closing check read T1 at 780 us on its first run and 535 / 469
# / 392 on re-runs minutes later, every CPU part of the call (the caller's encode too) up to
# 2.4x slower at first; whether the machine (other processes, steal, clocks) or our code
# warms up is read from here. `machine_summary` prints the short form.
machine_watch() {
  local parent=$$ log=$OUT/machine.log
  (
    trap - EXIT
    echo "# machine.log: t_s busy% iowait% steal% load1 mhz_mean mhz_min mhz_max gpu_sm_mhz"
    ps -eo pid,pcpu,etimes,rss,comm --sort=-pcpu | head -12 | sed 's/^/# ps /'
    lscpu 2>/dev/null | grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA|Model name)" | sed 's/^/# lscpu /'
    read -r _ u n sy id io irq sirq st _ </proc/stat
    local prev=$((u + n + sy + id + io + irq + sirq + st)) pidle=$id pio=$io pst=$st i=0
    while kill -0 "$parent" 2>/dev/null && ((i < ${WATCH_S:-900})); do
      sleep 1
      i=$((i + 1))
      read -r _ u n sy id io irq sirq st _ </proc/stat
      local tot=$((u + n + sy + id + io + irq + sirq + st))
      local d=$((tot - prev > 0 ? tot - prev : 1))
      local gpu
      gpu=$( ((i % 2)) && nvidia-smi --query-gpu=clocks.sm --format=csv,noheader,nounits \
        2>/dev/null | head -1)
      [[ $gpu =~ ^[0-9]+$ ]] || gpu=-  # (none, or a message: no GPU)
      printf '%d %d %d %d %s %s %s\n' "$i" "$((100 * (d - (id - pidle) - (io - pio)) / d))" \
        "$((100 * (io - pio) / d))" "$((100 * (st - pst) / d))" \
        "$(cut -d' ' -f1 /proc/loadavg)" \
        "$(awk -F: '/^cpu MHz/ {s += $2; n++; if (!mn || $2 < mn) mn = $2; if ($2 > mx) mx = $2}
          END {if (n) printf "%.0f %.0f %.0f", s / n, mn, mx; else printf "- - -"}' /proc/cpuinfo)" \
        "$gpu"
      prev=$tot pidle=$id pio=$io pst=$st
      # every 10 s the busiest processes, and their busiest threads with the CPU each is on
      # (psr): where the worker's and the caller's threads ran
      ((i % 10)) || { ps -eo pid,pcpu,etimes,rss,comm --sort=-pcpu | head -6 | sed "s/^/# ps $i s /"
        ps -eLo pid,tid,psr,pcpu,comm --sort=-pcpu | head -9 | sed "s/^/# threads $i s /"; }
    done
  ) </dev/null >"$log" 2>&1 &
}
# machine_summary: machine.log's busiest and most stolen seconds, and the processes first seen.
machine_summary() {
  awk '!/^#/ {n++; if ($2 > b) b = $2; if ($4 > s) s = $4; st += $4; if ($6 != "-") {
         if (!m || $6 < m) m = $6; if ($6 > M) M = $6}}
       END {printf "# machine: %d s sampled, busy max %d%%, steal max %d%% mean %.1f%%, " \
         "mean MHz %s-%s\n", n, b, s, (n ? st / n : 0), m, M}' "$OUT/machine.log" 2>/dev/null
  grep -m 6 '^# ps ' "$OUT/machine.log" 2>/dev/null | cut -c1-100
}

# tree_commit [DIR]: the commit of the tree at DIR (.): its COMMIT file, which the sender writes
# into a shipped copy (whose git metadata, if any, may be another checkout's), else git's.
tree_commit() {
  cat "${1:-.}/COMMIT" 2>/dev/null || git -C "${1:-.}" log -1 --format=%h 2>/dev/null || echo "?"
}

# bound LIMIT [RESERVE]: LIMIT, or less where the bundle's bound (BOUND seconds after
# gpu_session's start) comes sooner, keeping RESERVE seconds (default $RESERVE, else 0) for
# what comes after; a command given that many seconds cannot take the bundle past its bound.
# BOUND unset: LIMIT.
bound() {
  [[ -z ${BOUND:-} ]] && { echo "$1"; return; }
  local rest=$((BOUND - $(date +%s) + T0 - ${2:-${RESERVE:-0}}))
  ((rest < $1)) && echo "$rest" || echo "$1"
}
# left SECONDS: whether SECONDS more still end inside BOUND (always, BOUND unset).
left() { [[ -z ${BOUND:-} ]] || (($(date +%s) - T0 + $1 <= BOUND)); }

# step NAME LIMIT CMD...: CMD under `timeout` (LIMIT, cut by `bound`; skipped with rc 124 when
# under a second is left), its output in $OUT/NAME.log; prints "# NAME rc=RC at S s", keeps
# "NAME rc=RC <the log's last line>" in STEPS (`steps` prints them) and in $FINAL/progress.txt,
# adds "NAME<TAB>RC<TAB>SECONDS<TAB>LIMIT<TAB>how" to $OUT/steps.tsv (how: ran, cut = killed at
# its limit, skipped = no time left in the bound; bench/check_targets.py reads it: a target whose
# step was cut reads "cut", not "not run"), and archives, so what has run comes back even if the
# device time runs out before the end. Returns CMD's exit status. (A variable set before `step`
# reaches CMD; `env -C DIR CMD` runs it in DIR.)
step() {
  local name=$1 limit rc=124 t=$SECONDS how=skipped
  limit=$(bound "$2")
  shift 2
  if ((limit >= 1)); then
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    how=ran
    ((rc == 124 || rc == 137)) && how=cut
  else
    echo "skipped: $(elapsed) of the bound ($BOUND s)" >"$OUT/$name.log"
  fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t))" "$limit" "$how" \
    >>"$OUT/steps.tsv"
  STEPS+=("$(printf '%-16s rc=%-3s %s' "$name" "$rc" \
    "$(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-110)")")
  echo "# $name rc=$rc at $(elapsed)"
  printf '%s\n' "${STEPS[-1]}" >>"$FINAL/progress.txt"
  archive 2>/dev/null  # (a log still being written makes tar warn)
  return "$rc"
}
steps() { printf '%s\n' "${STEPS[@]}"; }
# step_if NEED NAME LIMIT CMD...: `step NAME LIMIT CMD...` where NEED more seconds still end
# inside BOUND (`left NEED`), else not started and recorded as step records one with no time
# left (rc 124, "skipped" in steps.tsv, STEPS and progress.txt), so what did not fit shows in
# the table. In place of `left N && step ...` (nothing recorded) and `if left N; then step ...;
# else note ...; fi`.
step_if() {
  local need=$1
  shift
  if left "$need"; then
    step "$@"
  else
    step "$1" 0 "${@:3}"
  fi
}

# ab_runs NEED FN VARIANT...: an alternated A/B. Calls `FN RUN NAME` once per VARIANT, in the
# order given (e.g. "a b b a": a drift of the machine then weighs on both sides alike), RUN =
# NAME_ROUND (NAME's first, second, ... run: a file stem for its logs). VARIANT = NAME or
# NAME:VAR=VALUE[,VAR=VALUE...]: FN runs with those variables exported (the worker's Q6SERVE_*
# switches, or the script's own knobs, e.g. FRONTENDS=6). A NAME that starts with "base" runs
# with the base tree's q6serve first on PYTHONPATH (`base_tree` first). A run that would not end
# inside BOUND (NEED seconds) is skipped and noted.
ab_runs() {
  local need=$1 fn=$2 v name run
  local -A round=()
  shift 2
  for v in "$@"; do
    name=${v%%:*}
    round[$name]=$((${round[$name]:-0} + 1))
    run=${name}_${round[$name]}
    if ! left "$need"; then
      note "# $run skipped at $(elapsed) (bound $BOUND s)"
      continue
    fi
    local envs=()
    [[ $v == *:* ]] && IFS=, read -ra envs <<<"${v#*:}"
    _ab_run "$fn" "$run" "$name" "${envs[@]}"
  done
}
_ab_run() {  # FN RUN NAME [VAR=VALUE...]: one run, the variables local to it (gone after it)
  local fn=$1 run=$2 name=$3
  shift 3
  (($#)) && local -x "$@"
  [[ $name == base* ]] && local -x PYTHONPATH=${BASEPP:?ab_runs: a base variant needs base_tree}
  "$fn" "$run" "$name"
}

# archive: every file under $OUT into $FINAL/$ARCHIVE.tgz (the device tool brings back 8 files
# at most, so the logs travel as one), fast (gzip -1), without what is too large to bring back
# and read as text anyway: per-call arrays (*.npy) and Nsight Compute reports (*.ncu-rep: import
# them into text first).
archive() {
  tar -I "gzip -1" --exclude="*.npy" --exclude="*.ncu-rep" -cf "$FINAL/$ARCHIVE.tgz" -C "$OUT" .
}

# table: the script's short table from stdin into summary.txt (in $OUT and $FINAL), every log
# archived, then the table printed: a script's last output.
table() {
  cat >"$OUT/summary.txt"
  archive
  cp "$OUT/summary.txt" "$FINAL/"
  cat "$OUT/summary.txt"
}

# worker_pid [TRIES]: the pid of the bench's worker process (`q6serve worker`), polled every
# 0.25 s up to TRIES times (40); empty if none started.
worker_pid() {
  local pid="" i
  for ((i = 0; i < ${1:-40}; i++)); do
    pid=$(pgrep -f "q6serve.client.cli worker" | head -1)
    [[ -n $pid ]] && break
    sleep 0.25
  done
  echo "$pid"
}

# base_tree DIR: BASE = DIR's absolute path and BASEPP a PYTHONPATH that imports q6serve from
# that tree (its source folders linked under a package root) ahead of this tree's install, for
# A/Bs of two trees in one call (ab_runs' "base" variants); NOWPP keeps this tree's PYTHONPATH.
# DIR is a copy of the base commit shipped beside this tree. Prints where the base code is.
base_tree() {
  local over=/tmp/base_path_$$ d
  BASE=$(cd "$1" && pwd) || exit 1
  mkdir -p "$over/q6serve"
  for d in kernels service client; do ln -sfn "$BASE/$d" "$over/q6serve/$d"; done
  ln -sfn "$BASE/proto/q6serve/v1" "$over/q6serve/v1"
  BASEPP="$over${PYTHONPATH:+:$PYTHONPATH}"
  NOWPP=${PYTHONPATH:-}
  PYTHONPATH=$BASEPP python3 -c "import q6serve.service as s; print('# base code', s.__file__)"
}

# dp_variant V: a data-plane variant of bench/gpu_dataplane_run.sh's VARIANTS: front ends, each
# optionally @US (the worker's GIL switch interval, Q6SERVE_GIL_SWITCH_US; Python's default 5000),
# :S (a front end's stacks in flight per key, Q6SERVE_FRONTEND_STACKS; default 2, 0 = no
# limit), :m0 (Q6SERVE_DEVICE_MERGE=0), rr (Q6SERVE_FRONTEND_ROUND_ROBIN=1); e.g. "8@200",
# "8:0", "8:m0", "6rr". Sets DP_F (the front-end count), DP_TAG (its file stem's part: f8,
# f8_gil200, f8_stacks0, f8_merge0, f6_rr) and DP_ENV (the worker's VAR=VALUE for `env`).
dp_variant() {
  local v=$1 us="" st="" mg="" rr=""
  DP_F=${v%%[@:]*}
  [[ $v =~ @([0-9]+) ]] && us=${BASH_REMATCH[1]}
  [[ $v =~ :([0-9]+) ]] && st=${BASH_REMATCH[1]}
  [[ $v == *:m0* ]] && mg=0
  [[ $v == *rr* ]] && rr=1
  DP_F=${DP_F%rr}
  DP_TAG=f$DP_F${us:+_gil$us}${st:+_stacks$st}${mg:+_merge0}${rr:+_rr}
  DP_ENV=("Q6SERVE_GIL_SWITCH_US=$us" "Q6SERVE_FRONTEND_STACKS=$st"
    "Q6SERVE_DEVICE_MERGE=${mg:-1}" "Q6SERVE_FRONTEND_ROUND_ROBIN=${rr:-0}")
}

# note TEXT: print it and add it to $FINAL/progress.txt (what is done comes back even if the
# call is cut).
note() { echo "$*" | tee -a "$FINAL/progress.txt"; }
