#!/usr/bin/env bash
# Issue 43's one-stream options on the lent H200 (docs/performance.md rounds 36-40): fp8_x_f16
# (on by default with FP8 weights since round 38: the kernels that write the residual stream's
# shadow, SiLU * up and the final norm also write x's f16 form, so the FP8 skinny kernels
# convert none of it), fp8_x_sumsq (round 39: x's sums of squares handed over too, on by
# default in the one-row bucket, where it was faster, and off at more rows, where it was
# slower) and qkv_release_early (attention's CTAs launch at the qkv projection's start and load
# their first keys while it runs; round 38 found it 1-2% faster on the 1B FP8 step and no faster
# on the 8B one; since round 41 on by default where a layer's weights are at most 128 MiB):
#   part 1 (about three minutes): their GPU tests (the _xf16 and _xf16sq kernels against the
#     converting ones and float64, the embedding's and the final norm's forms, the forward
#     passes with each on and off);
#   part 2 (about three minutes): bench_decode at batch 1 and 8 on Llama-3.1-8B and 3.2-1B, FP8
#     weights with the FP8 cache (issue 43's one-stream configuration) with fp8_x_sumsq off
#     (nosq), as shipped (on in the one-row bucket only), and on at every row count up to 8, in
#     two orders;
#   part 3 (about three minutes): bf16 with and without qkv_release_early, then the batch-1
#     breakdown (each op alone) of FP8 without and with fp8_x_f16.
# Then bench_serving --suite targets --quantization fp8 --kv-cache-dtype fp8 shows the live
# path (8B one stream: 2.3 ms a token is issue 43's target).
#   deploy/fp8_step_check.sh 1 [pytest args] | 2 [bench_decode args] | 3
set -uo pipefail
part=${1:-}
[[ $part == [123] ]] || {
  echo "usage: deploy/fp8_step_check.sh 1 [pytest args] | 2 [bench_decode args] | 3" >&2; exit 2; }
shift
source "$(dirname "$0")/gpu_env.sh"
if [ "$part" = 1 ]; then
  timeout "${BLINK_TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_cuda_forward.py \
    -k "x_f16 or x_sumsq or test_embedding or test_rms_norm or qkv_release" "$@" \
    2>&1 | tee -a "$OUT/fp8_step_tests.log" | tail -8
  exit "${PIPESTATUS[0]}"
fi
bench() {
  timeout "${BLINK_DECODE_TIMEOUT:-200}" python3 -m blink.gpu_engine.bench_decode \
    --shapes llama-3.1-8b llama-3.2-1b "$@" 2>&1 | tee -a "$OUT/fp8_step_bench.log" \
    | grep -E "^\| |^=== |^#|^breakdown"
}
fp8=quantization=fp8,kv_cache_dtype=fp8
if [ "$part" = 2 ]; then
  [ $# -gt 0 ] || set -- --points 1x512 8x512
  bench --no-bf16 --options nosq:$fp8,fp8_x_sumsq=0 fp8:$fp8 allsq:$fp8,fp8_x_sumsq=1 "$@"
  bench --no-bf16 --options allsq:$fp8,fp8_x_sumsq=1 fp8:$fp8 nosq:$fp8,fp8_x_sumsq=0 "$@"
  exit
fi
bench --no-bf16 --points 1x512 8x512 --options late:qkv_release_early=0 early:qkv_release_early=1
# where the step's time moved, op by op (each op alone, batch 1)
bench --no-bf16 --points 1x512 --breakdown 1x512 --options noxf16:$fp8,fp8_x_f16=0 fp8:$fp8
