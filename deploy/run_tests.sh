#!/usr/bin/env bash
# Sets up the test environment and runs the test suite (GPU tests skip on machines without one).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh test
exec .venv/bin/python -m pytest -q "$@"
