#!/usr/bin/env bash
# Where the projection chain (csrc/gemv_chain.cuh) should run by default, in one command on the
# lent H200 (about two minutes): its kernel and forward tests, then batch 1 at 512 keys on four
# shapes whose o, gate|up and down weights span 109 to 386 MB a layer (Llama-3.2-1B, Llama-3.2-3B,
# Qwen3-4B, Llama-3.1-8B), each with the chain nowhere, everywhere, and by the rule
# (ForwardKernels.CHAIN_MIN_LAYER_BYTES, the "default" variant), then the same with FP8 weights
# (the fp8 variants; CHAIN_MIN_LAYER_BYTES_FP8). Set each line between the largest shape the
# chain loses on and the smallest it wins on.
#   deploy/chain_rule_check.sh [bench_decode args]     e.g. --points 1x512 1x8192
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout "${BLINK_TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_cuda_forward.py -k "projection_chain" 2>&1 | tee "$OUT/chain_tests.log"
[ $# -gt 0 ] || set -- --points 1x512
timeout "${BLINK_DECODE_TIMEOUT:-420}" python3 -m blink.gpu_engine.bench_decode \
  --shapes llama-3.2-1b llama-3.2-3b qwen3-4b llama-3.1-8b \
  --options nochain:projection_chain=0 chain:projection_chain=1 fp8:quantization=fp8 \
  fp8nochain:quantization=fp8,projection_chain=0 fp8chain:quantization=fp8,projection_chain=1 \
  "$@" \
  2>&1 | tee "$OUT/chain_rule.log"
