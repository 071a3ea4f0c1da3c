#!/usr/bin/env bash
# Issue 14, session 7 (helper t1): why a step of the 7B replay at S=64 keeps ~27 ms more
# "device" time with multi-weight calls than with single-weight ones (both on the direct path,
# the same kernels in the same order). One device call (~60 s): bench/service.py --replay
# --replay-seqs 64 (multi, then single) with py-spy sampling the worker in 1 s slices, each
# tagged with the phase it ended in; bench/replay_spy.py compares the phases.
# $OUT gets t1spy.tgz and summary.txt.   bench/gpu_t1_spy.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/gpu_lib.sh
source bench/gpu_lib.sh
gpu_session /tmp/t1spy
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
timeout "${LIMIT:-55}" python3 bench/service.py --backend "${BACKEND:-cuda}" --replay --replay-seqs 64 ${REPLAY_ARGS:-} \
  --seconds "${SECONDS_PER_RUN:-2}" --warmup 0.3 --no-replay-floor \
  --json "$OUT/replay.json" >"$OUT/replay.log" 2>&1 &
bench=$!
wpid=$(worker_pid 80)
while kill -0 "$bench" 2>/dev/null && ! grep -q "^# uploaded" "$OUT/replay.log"; do sleep 0.2; done
echo "# uploaded ($(elapsed)), worker $wpid"
i=0
while kill -0 "$bench" 2>/dev/null && [[ -n $wpid ]] && ((i < 60)); do
  timeout 4 "$SPY" record -p "$wpid" -d 1 -r 400 -f raw --nonblocking \
    -o "$OUT/spy_$i.raw" >/dev/null 2>&1
  # the phase: how many of the replay's configurations had finished when the slice ended
  echo "$OUT/spy_$i.raw done$(grep -c '^replay S' "$OUT/replay.log")" >>"$OUT/slices.txt"
  i=$((i + 1))
done
wait "$bench"
echo "# replay rc=$? ($(elapsed))"
{
  echo "# gpu_t1_spy $(cat COMMIT 2>/dev/null) $(elapsed)"
  grep -E "^replay S|per step" "$OUT/replay.log"
  echo "## phases: done0 = S=64 multi (with its warm-up), done1 = S=64 single"
  python3 bench/replay_spy.py "$OUT/slices.txt" --top 22
} >"$OUT/summary.txt" 2>&1
tar czf "$FINAL/t1spy.tgz" -C "$OUT" .
cp "$OUT/summary.txt" "$FINAL/"
cat "$OUT/summary.txt"
