#!/bin/sh
# Entry of a shard pod: start the worker, load this pod's rows, stay in front of the worker.
#
# The shard index is the pod's StatefulSet ordinal (POD_NAME q6serve-shard-3 -> 3); the rows of
# each tensor are shard <index> of Q6SERVE_SHARD_COUNT in the even split (remainder to the first
# shards), exactly `q6serve load --shard-index I --shard-count N`. Readiness is the file
# $READY: it appears once the rows are loaded and goes away on SIGTERM, before the drain.
# Arguments ("$@", the container's args) go to `q6serve worker`.
set -eu
: "${POD_NAME:?set POD_NAME from the downward API (metadata.name)}"
: "${Q6SERVE_SHARD_COUNT:?set Q6SERVE_SHARD_COUNT (= the StatefulSet replicas)}"
: "${Q6SERVE_SHARD_GGUF:?set Q6SERVE_SHARD_GGUF (a file under the model dir)}"
TENSORS="${Q6SERVE_SHARD_TENSORS:-}"  # space-separated; empty: every Q6_K tensor of the file
PORT="${Q6SERVE_SHARD_PORT:-50051}"  # the image's gRPC port (ENTRYPOINT); tests override
READY="${Q6SERVE_SHARD_READY_FILE:-/tmp/q6serve-shard-ready}"
TARGET="127.0.0.1:$PORT"

index="${POD_NAME##*-}"
case "$index" in
  '' | *[!0-9]*) echo "shard-entry: no ordinal at the end of POD_NAME=$POD_NAME" >&2; exit 2 ;;
esac
if [ "$index" -ge "$Q6SERVE_SHARD_COUNT" ]; then
  echo "shard-entry: ordinal $index >= Q6SERVE_SHARD_COUNT=$Q6SERVE_SHARD_COUNT" \
       "(scale the StatefulSet and the count together)" >&2
  exit 2
fi
rm -f "$READY"

q6serve worker --host 0.0.0.0 --port "$PORT" --metrics-port 9400 "$@" &
pid=$!
# SIGTERM: leave readiness first, then let the worker drain (it exits when done).
trap 'rm -f "$READY"; kill -TERM "$pid" 2>/dev/null || true' TERM INT

until q6serve health --target "$TARGET" --timeout 2 >/dev/null 2>&1; do
  if ! kill -0 "$pid" 2>/dev/null; then
    wait "$pid" || exit $?
    exit 1
  fi
  sleep 1
done

set --
for t in $TENSORS; do set -- "$@" --tensor "$t"; done
echo "shard-entry: loading shard $index of $Q6SERVE_SHARD_COUNT of $Q6SERVE_SHARD_GGUF" >&2
if ! q6serve load --target "$TARGET" --gguf "$Q6SERVE_SHARD_GGUF" --timeout 3600 \
     --shard-index "$index" --shard-count "$Q6SERVE_SHARD_COUNT" "$@"; then
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" || true
  exit 1
fi
touch "$READY"

# `wait` returns early when a trapped signal arrives; keep waiting until the worker has exited.
while :; do
  if wait "$pid"; then status=0; else status=$?; fi
  kill -0 "$pid" 2>/dev/null || break
done
exit "$status"
