#!/usr/bin/env bash
# The standard serving benchmark on the H200: Llama-3.2-1B and Llama-3.1-8B shapes (random bf16
# weights), ShareGPT prompts, systems side by side behind the same front end and client, each
# point run twice, and the saturating point again with 2 busy processes per server core
# (--cpu-hog). JSON, tables and plots under $OUT/bench-<shape>/.
#
#   blink, host-cuda (the CPU-free engine; its kernels driven by a host loop): a rate sweep
#     from light load to saturation (three rates), on every shape;
#   hf, hf-static (transformers' static-batching generate; its batch-1 static-cache compiled
#     path): these finish a few ShareGPT replies in the time the others finish all of them, so
#     they run only at saturation (all requests at once), each run cut at BENCH_PEER_RUN_S;
#     cut requests count as failed, and their tokens as streamed (the table shows both).
# The two parts of a shape are merged into one table and one set of plots (blink bench
# --report). Time, from the H200 run of 2026-11-30 (48 prompts; a run is bound by the longest
# ShareGPT reply, not by the prompt count): blink + host-cuda 1.5 min on the 1B shape and 3.3
# on the 8B shape, the peers 2 min a shape (start-up and torch.compile included): 528 s in all,
# one lent-machine command; each part is also cut by its own timeout.
# BENCH_SHAPES=llama-3.2-1b (or llama-3.1-8b) runs one shape.
#   deploy/bench_gpu.sh        (BENCH_SHAPES, BENCH_PROMPTS, BENCH_SYSTEMS, BENCH_PEERS,
#                               BENCH_PEER_SHAPES, BENCH_PEER_RUN_S override)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
cores=$(python3 -c "import os; print(len(os.sched_getaffinity(0)))")
hogs=$(( 2 * (cores - 2) ))
common=(--dataset sharegpt --num-prompts "${BENCH_PROMPTS:-48}" --repeats 2 --cpu-hog "$hogs"
        --hog-rates inf --max-model-len 4096)
status=0
for shape in ${BENCH_SHAPES:-llama-3.2-1b llama-3.1-8b}; do
  case $shape in
    llama-3.2-1b) rates="16 64 inf" ;;
    *) rates="8 32 inf" ;;
  esac
  dir=$OUT/bench-$shape
  parts=("$dir/serving/bench.json")
  timeout "${BENCH_TIMEOUT:-270}" python3 -m blink.client.cli bench --shape "$shape" \
    --systems ${BENCH_SYSTEMS:-blink host-cuda} --request-rate $rates --run-timeout 30 \
    "${common[@]}" --out "$dir/serving" 2>&1 | tee "$OUT/bench-$shape.log" || status=1
  if [[ " ${BENCH_PEER_SHAPES:-llama-3.2-1b llama-3.1-8b} " == *" $shape "* ]]; then
    timeout "${BENCH_PEER_TIMEOUT:-180}" python3 -m blink.client.cli bench --shape "$shape" \
      --systems ${BENCH_PEERS:-hf hf-static} --request-rate inf \
      --run-timeout "${BENCH_PEER_RUN_S:-5}" "${common[@]}" --out "$dir/peers" \
      2>&1 | tee "$OUT/bench-$shape-peers.log" || status=1
    parts+=("$dir/peers/bench.json")
  fi
  existing=()  # a part cut before its first run left no JSON
  for part in "${parts[@]}"; do [[ -f $part ]] && existing+=("$part"); done
  [[ ${#existing[@]} -gt 0 ]] && python3 -m blink.client.cli bench --report "${existing[@]}" \
    --out "$dir" 2>&1 | tee "$OUT/bench-$shape-report.log"
done
exit $status
