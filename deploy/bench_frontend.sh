#!/usr/bin/env bash
# The front end's capacity on a GPU host (issue 10), about 6 minutes, in two parts:
#   1. the front end alone: the synthetic engine (no model: every step a token for each running
#      sequence, as fast as its Python loop goes), 256 closed-loop streams of 16 + 1024 tokens,
#      front end with --workers 1, 2, 4 and 8, then 2 and 4 with --stream-interval-ms 5 (a
#      stream's tokens leave at most every 5 ms, several to a message); the client in 4
#      processes on 4 cores of its own. Each run prints streamed tokens/s and the front end's
#      CPU per streamed token.
#   2. the Llama-3.2-1B shape on the GPU at saturation (128 streams of 256 + 256 tokens), front
#      end with --workers 1 and 4, then 4 with the servers at niceness -10 (as `nice -n -10 blink
#      serve`; as root only): idle, then with one busy process on every server core; the
#      busy/idle ratios close each table.
# Logs and bench.json files under $OUT/frontend-*/.
#   deploy/bench_frontend.sh        (FRONTEND_WORKERS: WORKERS[:INTERVAL_MS] runs of part 1,
#                                    FRONTEND_1B_RUNS: WORKERS[:NICENESS] of part 2; empty: skip)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
client_procs=4
read -r server client nserver < <(python3 -c "
import os; c = sorted(os.sched_getaffinity(0)); k = $client_procs
print(','.join(map(str, c[:-k])) or '-', ','.join(map(str, c[-k:])), len(c) - k)")
if (( nserver < 4 )); then
  echo "bench_frontend.sh: needs at least $((client_procs + 4)) cores ($client_procs for the client)"
  exit 2
fi
echo "server cores $server, client cores $client"
status=0
bench() {  # name, timeout, bench arguments...: the run lines on stdout, the whole log kept
  local name=$1 limit=$2; shift 2
  mkdir -p "$OUT/$name"
  timeout "$limit" python3 -m blink.client.cli bench --server-cores "$server" \
    --out "$OUT/$name" "$@" > "$OUT/$name/bench.log" 2>&1 || status=1
  grep -E "run [0-9]|warning|rror|^\| (system|synthetic|blink|---)" "$OUT/$name/bench.log"
}
for run in ${FRONTEND_WORKERS-1 2 4 8 2:5 4:5}; do   # WORKERS[:INTERVAL_MS]
  workers=${run%%:*} interval=0
  [[ $run == *:* ]] && interval=${run#*:}
  bench "frontend-synthetic-w$workers-interval$interval" 120 --systems synthetic \
    --dataset random --random-input-len 16 --random-output-len 1024 --num-prompts 1024 \
    --concurrency 256 --client-procs "$client_procs" --connections 32 --repeats 2 \
    --frontend-arg=--workers="$workers" --frontend-arg=--stream-interval-ms="$interval"
done
default_1b="1 4"
[[ $(id -u) == 0 ]] && default_1b="1 4 4:-10"
for run in ${FRONTEND_1B_RUNS-$default_1b}; do   # WORKERS[:NICENESS]
  workers=${run%%:*} nice=0
  [[ $run == *:* ]] && nice=${run#*:}
  bench "frontend-1b-w$workers-nice$nice" 150 --shape llama-3.2-1b --dataset random \
    --random-input-len 256 --random-output-len 256 --num-prompts 512 --concurrency 128 \
    --client-procs 2 --connections 16 --repeats 2 --cpu-hog "$nserver" --max-model-len 4096 \
    --frontend-arg=--workers="$workers" --server-nice "$nice"
done
exit $status
