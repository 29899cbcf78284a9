#!/usr/bin/env bash
# The standard serving benchmark on the H200: Llama-3.2-1B and Llama-3.1-8B shapes (random bf16
# weights), ShareGPT prompts, three systems side by side behind the same front end and client
# (blink: the CPU-free engine; host-cuda: its kernels driven by a host loop; hf: transformers'
# generate), a rate sweep from light load to saturation, the saturating point repeated to show
# the noise, and the same with 2 busy processes per server core (--cpu-hog). JSON, tables and
# plots under $OUT/bench-<shape>/.
#   deploy/bench_gpu.sh                       (BENCH_SHAPES, BENCH_PROMPTS, BENCH_SYSTEMS override)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
cores=$(python3 -c "import os; print(len(os.sched_getaffinity(0)))")
hogs=$(( 2 * (cores - 2) ))
status=0
for shape in ${BENCH_SHAPES:-llama-3.2-1b llama-3.1-8b}; do
  case $shape in
    llama-3.2-1b) rates="16 32 64 inf" ;;
    *) rates="8 16 32 inf" ;;
  esac
  # each run is cut at 30 s (the static-batching transformers peer can take longer than the
  # whole suite on ShareGPT's long replies; its cut requests count as failed, visibly)
  timeout "${BENCH_TIMEOUT:-270}" python3 -m blink.client.cli bench --shape "$shape" \
    --systems ${BENCH_SYSTEMS:-blink host-cuda hf} --dataset sharegpt \
    --num-prompts "${BENCH_PROMPTS:-64}" --request-rate $rates --repeats 2 --run-timeout 30 \
    --cpu-hog "$hogs" --hog-rates inf --max-model-len 4096 --out "$OUT/bench-$shape" \
    2>&1 | tee "$OUT/bench-$shape.log" || status=1
done
exit $status
