# shellcheck shell=bash
# Shared start of the bench/gpu_*.sh session scripts (sourced): `gpu_session DIR` makes $FINAL
# the folder the device tool brings back ($OUT as given, or ./out), points $OUT at DIR (cleared:
# every log lands there; the tool brings back 8 files at most, so scripts archive it into $FINAL),
# installs the carried wheels and the project (bench/gpu_run.sh none), prints the tree's commit
# from ./COMMIT where the sender wrote one, and starts the clock that `elapsed` reads.
gpu_session() {
  FINAL=${OUT:-$PWD/out}
  OUT=$1
  rm -rf "$OUT"
  mkdir -p "$FINAL" "$OUT"
  export PYTHONUNBUFFERED=1
  T0=$(date +%s)
  bench/gpu_run.sh none >"$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
  [[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site
  head -3 "$OUT/setup.log"
  # the shipped tree's commit (a copy's git metadata may be another checkout's)
  [[ -f COMMIT ]] && echo "tree $(cat COMMIT)"
}
elapsed() { echo "$(($(date +%s) - T0)) s"; }
