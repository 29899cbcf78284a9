#!/usr/bin/env bash
# Sets up, serves the built-in demo model on 127.0.0.1:50051 (engine + front end on this
# host), answers one request, and keeps serving until Ctrl-C (or exits with --exit).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh
PORT=${BLINK_PORT:-50051}
.venv/bin/blink serve --port "$PORT" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
.venv/bin/blink generate --target "127.0.0.1:$PORT" --wait 120 --max-tokens 48 \
  "The three most important ideas in computer science are"
if [ "${1:-}" = "--exit" ]; then
  exit 0
fi
echo "blink is serving on 127.0.0.1:$PORT; try: .venv/bin/blink generate \"Hello\"  (Ctrl-C stops it)"
wait $SERVER
