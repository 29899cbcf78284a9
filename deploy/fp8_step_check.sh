#!/usr/bin/env bash
# Issue 43's one-stream candidates on the lent H200 (docs/performance.md rounds 36 and 37), both
# off until this times them: fp8_x_f16 (the kernels that write the residual stream's shadow, SiLU
# * up and the final norm also write x's f16 form, so the FP8 skinny kernels convert none of it;
# round 29 timed the conversions' ceiling at 61 µs of the 8B FP8 step), in two builds (the
# norm-folding kernels sum x's squares in their loop, or before it: BLINK_XF16_SQUARES_FIRST=1),
# and qkv_release_early (attention's CTAs launch at the qkv projection's start and load their
# first keys while it runs):
#   part 1 (about three minutes): their GPU tests (the _xf16 kernels against the converting ones
#     and float64, the embedding's and the final norm's forms, the forward passes bit for bit
#     with each on and off), the x_f16 ones in both builds;
#   part 2 (about five minutes): bench_decode at batch 1 and 8 on Llama-3.1-8B and 3.2-1B, FP8
#     weights with the FP8 cache (issue 43's one-stream configuration) plain, with each option
#     and with both, in two orders, and between them fp8_x_f16 in the squares-first build
#     (its own processes: the macro builds another module);
#   part 3 (about four minutes): bf16 with and without qkv_release_early, then the batch-1
#     breakdown (each op alone) of FP8 plain and with fp8_x_f16 in both builds.
# What wins becomes the default; then bench_serving --suite targets --quantization fp8
# --kv-cache-dtype fp8 shows it on the live path (8B one stream: 2.3 ms a token is the target).
#   deploy/fp8_step_check.sh 1 [pytest args] | 2 [bench_decode args] | 3
set -uo pipefail
part=${1:-}
[[ $part == [123] ]] || {
  echo "usage: deploy/fp8_step_check.sh 1 [pytest args] | 2 [bench_decode args] | 3" >&2; exit 2; }
shift
source "$(dirname "$0")/gpu_env.sh"
first=${BLINK_NVCC_DEFINES:+$BLINK_NVCC_DEFINES,}BLINK_XF16_SQUARES_FIRST=1  # (added to any)
if [ "$part" = 1 ]; then
  tests() {
    timeout "${BLINK_TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/test_cuda_forward.py "$@" 2>&1 | tee -a "$OUT/fp8_step_tests.log" | tail -8
    return "${PIPESTATUS[0]}"
  }
  tests -k "x_f16 or test_embedding or test_rms_norm or qkv_release" "$@"; status=$?
  BLINK_NVCC_DEFINES=$first tests -k "x_f16" "$@" || status=$?
  exit $status
fi
bench() {
  timeout "${BLINK_DECODE_TIMEOUT:-200}" python3 -m blink.gpu_engine.bench_decode \
    --shapes llama-3.1-8b llama-3.2-1b "$@" 2>&1 | tee -a "$OUT/fp8_step_bench.log" \
    | grep -E "^\| |^=== |^#|^breakdown"
}
fp8=quantization=fp8,kv_cache_dtype=fp8 xf=fp8_x_f16=1 early=qkv_release_early=1
if [ "$part" = 2 ]; then
  [ $# -gt 0 ] || set -- --points 1x512 8x512
  bench --no-bf16 --options fp8:$fp8 xf16:$fp8,$xf early:$fp8,$early both:$fp8,$xf,$early "$@"
  BLINK_NVCC_DEFINES=$first bench --no-bf16 --options xf16first:$fp8,$xf "$@"
  BLINK_NVCC_DEFINES=$first bench --no-bf16 --options xf16first:$fp8,$xf "$@"
  bench --no-bf16 --options both:$fp8,$xf,$early early:$fp8,$early xf16:$fp8,$xf fp8:$fp8 "$@"
  exit
fi
bench --points 1x512 8x512 --options early:$early
# where the step's time moved, op by op (each op alone, batch 1)
bench --no-bf16 --points 1x512 --breakdown 1x512 --options fp8:$fp8 xf16:$fp8,$xf
BLINK_NVCC_DEFINES=$first bench --no-bf16 --points 1x512 --breakdown 1x512 \
  --options xf16first:$fp8,$xf
