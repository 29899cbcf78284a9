#!/usr/bin/env bash
# The open performance issues' live figures in one command, through gRPC with the scheduler
# kernel (bench_serving; random weights in real shapes): issue 43's (FP8 weights and KV cache,
# --suite targets on Llama-3.1-8B and Llama-3.2-1B), issue 45's (Llama-3.2-1B in bf16, --suite
# decode, with the step log's split of each step) and issue 44's (the 8B prefix suite with and
# without the cache). 258 s on an H100 (2026-12-06), under the lent machine's 600-s command
# limit; logs under $OUT. BLINK_FIGURES_BUDGET (seconds, default 580) bounds the three
# together, for a call that runs something else first; a part that would pass it is cut short.
#   deploy/issue_figures.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
serving="python3 -m blink.client.bench_serving"
start=$(date +%s)
budget=${BLINK_FIGURES_BUDGET:-580}
run() {  # run LOG TIMEOUT ARGS...: one bench_serving command, its log and its tables
  local log=$1 limit=$2 left
  shift 2
  left=$(( budget - ($(date +%s) - start) ))
  [ "$limit" -le "$left" ] || limit=$left
  [ "$limit" -ge 1 ] || limit=1  # (timeout 0 would mean none)
  timeout "$limit" $serving "$@" > "$OUT/$log" 2>&1
  echo "== $log: exit $?, $(( $(date +%s) - start )) s"
  grep -E "^\||^step log" "$OUT/$log"
}
run fp8_targets.log 300 --shapes llama-3.1-8b llama-3.2-1b --suite targets \
  --quantization fp8 --kv-cache-dtype fp8
run bf16_1b_decode.log 120 --shapes llama-3.2-1b --suite decode --step-log
run prefix.log "$budget" --shapes llama-3.1-8b --suite prefix --compare-prefix-caching
