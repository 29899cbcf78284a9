#!/usr/bin/env bash
# Regenerates the Python gRPC code from blink.proto (the generated files are committed so the
# package installs without grpcio-tools; tests/test_proto.py checks they are current).
set -euo pipefail
cd "$(dirname "$0")"
python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. blink/v1/blink.proto
