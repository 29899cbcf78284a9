#!/usr/bin/env bash
# Sets up, serves the built-in demo model on 127.0.0.1:50051 (engine + front end on this
# host), answers one request, and keeps serving until Ctrl-C (or exits with --exit).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh
PORT=${BLINK_PORT:-50051}
READY=$(mktemp -u "${TMPDIR:-/tmp}/blink-quickstart.XXXXXX")
.venv/bin/blink serve --port "$PORT" --ready-file "$READY" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -f "$READY"' EXIT
# the request goes to this server: one that failed to start (the port taken by another) ends
# the script with its own message, not another server's answer
until [ -s "$READY" ]; do
  if ! kill -0 $SERVER 2>/dev/null; then
    wait $SERVER && status=0 || status=$?
    echo "quickstart: blink serve did not start (exit status $status)" >&2
    exit 1
  fi
  sleep 0.2
done
.venv/bin/blink generate --target "127.0.0.1:$PORT" --wait 120 --max-tokens 48 \
  "The three most important ideas in computer science are"
if [ "${1:-}" = "--exit" ]; then
  exit 0
fi
echo "blink is serving on 127.0.0.1:$PORT; try: .venv/bin/blink generate \"Hello\"  (Ctrl-C stops it)"
wait $SERVER
