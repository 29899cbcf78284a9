#!/usr/bin/env bash
# Creates .venv with Blink installed. `deploy/setup.sh test` adds the test oracle
# (transformers on the CPU build of torch), grpcio-tools and the benchmark's extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ "${1:-}" = "test" ]; then
  .venv/bin/python -m pip install -q -e '.[test,bench]'
else
  .venv/bin/python -m pip install -q -e .
fi
