#!/usr/bin/env bash
# Fail when the committed gRPC stubs differ from what the .proto generates.
set -euo pipefail
PY=${1:-python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m grpc_tools.protoc -Iproto --python_out="$tmp" --grpc_python_out="$tmp" --pyi_out="$tmp" \
  proto/llamafleet/agent/v1/agent.proto
for f in agent_pb2.py agent_pb2.pyi agent_pb2_grpc.py; do
  if ! diff -q "$tmp/llamafleet/agent/v1/$f" "proto/llamafleet/agent/v1/$f" >/dev/null; then
    echo "proto/llamafleet/agent/v1/$f is stale: run 'make proto' and commit the result." >&2
    exit 1
  fi
done
echo "gRPC stubs are current"
