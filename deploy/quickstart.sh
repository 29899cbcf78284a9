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
trap 'rm -f "$READY"; kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
# the request goes to this server: one that failed to start (the port taken by another) ends
# the script with its own message, not another server's answer
for _ in $(seq 600); do  # (its port is bound within seconds; 120 s at most)
  [ -s "$READY" ] && break
  if ! kill -0 $SERVER 2>/dev/null; then
    wait $SERVER && status=0 || status=$?
    echo "quickstart: blink serve did not start (exit status $status)" >&2
    exit 1
  fi
  sleep 0.2
done
[ -s "$READY" ] || { echo "quickstart: blink serve did not listen within 120 s" >&2; exit 1; }
.venv/bin/blink generate --target "127.0.0.1:$PORT" --wait 120 --max-tokens 48 \
  "The three most important ideas in computer science are"
if [ "${1:-}" = "--exit" ]; then
  exit 0
fi
echo "blink is serving on 127.0.0.1:$PORT; try: .venv/bin/blink generate \"Hello\"  (Ctrl-C stops it)"
wait $SERVER
