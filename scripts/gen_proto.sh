#!/usr/bin/env bash
# Regenerate the committed Python stubs of proto/q6serve/v1/*.proto.
# Usage: scripts/gen_proto.sh [OUT_DIR]   (default: proto, i.e. in place)
# The stubs import as `q6serve.v1` because proto/q6serve/v1 installs as that package.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-proto}"
py="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
"$py" -m grpc_tools.protoc -I proto --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" proto/q6serve/v1/q6serve.proto
