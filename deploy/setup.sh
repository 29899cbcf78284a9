#!/usr/bin/env bash
# Creates .venv with Blink installed. `deploy/setup.sh test` adds the test oracle
# (transformers on the CPU build of torch), grpcio-tools and the benchmark's extra.
# The install is editable, so only a change of pyproject.toml (or of the extras asked for)
# needs pip again: a stamp in .venv records what was installed, and a rerun skips pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ "${1:-}" = "test" ]; then
  target='.[test,bench]'
else
  target='.'
fi
stamp=".venv/.blink-installed-$(cat pyproject.toml | sha256sum | cut -c1-16)-${1:-serve}"
if [ -f "$stamp" ] && .venv/bin/python -c "import blink.client.cli" 2>/dev/null; then
  exit 0  # installed from this pyproject.toml already
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ "${1:-}" = "test" ] && [ -n "${TORCH_INDEX_URL:-}" ]; then
  # where pip would take PyTorch's CUDA build (public PyPI on x86_64: several GB), the CPU
  # one first: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu deploy/setup.sh test
  .venv/bin/python -m pip install -q "$(grep -o 'torch==[0-9.]*' pyproject.toml)" \
    --index-url "$TORCH_INDEX_URL"
fi
.venv/bin/python -m pip install -q -e "$target"
rm -f .venv/.blink-installed-*-"${1:-serve}"
touch "$stamp"
