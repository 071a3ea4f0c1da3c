# shellcheck shell=bash
# Shared start of the bench/gpu_*.sh session scripts (sourced): `gpu_session DIR` makes $FINAL
# the folder the device tool brings back ($OUT as given, or ./out), points $OUT at DIR (cleared:
# every log lands there; the tool brings back 8 files at most, so scripts archive it into $FINAL),
# installs the carried wheels and the project (bench/gpu_run.sh none; DRY_RUN=1: neither, a CPU
# rehearsal with a stand-in nvidia-smi), prints the tree's commit from ./COMMIT where the sender
# wrote one, and starts the clock that `elapsed` reads.
gpu_session() {
  FINAL=${OUT:-$PWD/out}
  OUT=$1
  rm -rf "$OUT"
  mkdir -p "$FINAL" "$OUT"
  export PYTHONUNBUFFERED=1
  T0=$(date +%s)
  if [[ -n ${DRY_RUN:-} ]]; then  # a CPU rehearsal of a script (BACKEND=numpy): no install
    nvidia-smi() { echo "no GPU (dry run)"; }
    return 0
  fi
  bench/gpu_run.sh none >"$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
  [[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site
  head -3 "$OUT/setup.log"
  # the shipped tree's commit (a copy's git metadata may be another checkout's)
  [[ -f COMMIT ]] && echo "tree $(cat COMMIT)"
}
elapsed() { echo "$(($(date +%s) - T0)) s"; }

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
# A/Bs of two trees in one call; NOWPP keeps this tree's PYTHONPATH. Prints where the base code is.
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

# note TEXT: print it and add it to $FINAL/progress.txt (what is done comes back even if the
# call is cut).
note() { echo "$*" | tee -a "$FINAL/progress.txt"; }
