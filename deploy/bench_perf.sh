#!/usr/bin/env bash
# Blink's performance on the H200 in one command (about 10 minutes): the decode step of the
# forward graph beside its floor with a per-op breakdown (Llama-3.1-8B at batch 1 and 32,
# Llama-3.2-1B at batch 1), 2,048-token prefill chunks at contexts up to 8,192 broken down in
# FLOP/s (both shapes), a saturation step (8B: 256 decodes, alone and with a 256-token prompt's
# chunk), then the live serving path (scheduler kernel, ring, gRPC) on both shapes: decode,
# saturation and long-context workloads. Logs and tables under $OUT.
#   deploy/bench_perf.sh [bench_serving args]      e.g. --shapes llama-3.1-8b --suite decode
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout "${BLINK_DECODE_TIMEOUT:-240}" python3 -m blink.gpu_engine.bench_decode \
  --shapes llama-3.1-8b --points 1x512 16x512 32x512 1x8192 32x4096 --breakdown 1x512 32x512 --cublas \
  2>&1 | tee "$OUT/bench_decode_8b.log"
timeout "${BLINK_DECODE_TIMEOUT:-240}" python3 -m blink.gpu_engine.bench_decode \
  --shapes llama-3.2-1b --points 1x512 16x512 32x512 --breakdown 1x512 --cublas \
  2>&1 | tee "$OUT/bench_decode_1b.log"
timeout "${BLINK_DECODE_TIMEOUT:-240}" python3 -m blink.gpu_engine.bench_decode \
  --points --prefill 2048x2048 2048x4096 2048x8192 \
  2>&1 | tee "$OUT/bench_prefill.log"
timeout "${BLINK_DECODE_TIMEOUT:-240}" python3 -m blink.gpu_engine.bench_decode \
  --shapes llama-3.1-8b --points 256x400 --breakdown 256x400 --mixed 256x400+256x256 \
  2>&1 | tee "$OUT/bench_saturation_step.log"
timeout "${BLINK_SERVING_TIMEOUT:-600}" python3 -m blink.client.bench_serving "$@" \
  2>&1 | tee "$OUT/bench_serving.log"
