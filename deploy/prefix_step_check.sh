#!/usr/bin/env bash
# Two ways to shorten a warm prefix request's step (issue 44: 100 own tokens after a cached
# 2,000-token prefix, a 100-token chunk at 2,100 keys), on the lent H200: the GEMM tuner's
# split-K variants (Cublas.split_k, `blink serve --gemm-split-k`) and finer buckets below 128
# (CudaForward(fine_buckets_from=64): the chunk runs as 112 rows, not 128).
#   part 1 (about five minutes): every GEMM candidate and its split-K variants against float64
#     (bf16 and FP8), the tuner's test; then Llama-3.1-8B's 100- and 52-token chunks and its
#     64- and 128-row decode steps with neither, each and both, in two orders;
#   part 2 (about four minutes): the split-K variants alone on 8B FP8 and Llama-3.2-1B;
#   after either, each tuner's choices for the shapes of up to 256 rows, from this machine's
#   cache.
#   deploy/prefix_step_check.sh 1|2 [bench_decode args]
set -uo pipefail
part=${1:?part 1 or 2}
shift
source "$(dirname "$0")/gpu_env.sh"
if [ "$part" = 1 ]; then
  timeout "${BLINK_TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_cuda_forward.py tests/test_cuda_fp8.py \
    -k "every_candidate or test_cublas_linear_fp8 or gemm_tuner" 2>&1 \
    | tee "$OUT/prefix_step_tests.log"
fi
[ $# -gt 0 ] || set -- --points 64x512 128x512 --prefill 100x2100 52x2100
bench() {
  timeout "${BLINK_DECODE_TIMEOUT:-150}" python3 -m blink.gpu_engine.bench_decode --no-bf16 \
    "$@" 2>&1 | tee -a "$OUT/prefix_step_bench.log"
}
both="gemm_split_k=1,fine_buckets_from=64"
if [ "$part" = 1 ]; then
  bench --shapes llama-3.1-8b --options plain:gemm_split_k=0 sk:gemm_split_k=1 \
    fine:fine_buckets_from=64 both:$both "$@"
  bench --shapes llama-3.1-8b --options both:$both fine:fine_buckets_from=64 \
    sk:gemm_split_k=1 plain:gemm_split_k=0 "$@"
else
  bench --shapes llama-3.1-8b --options fp8:quantization=fp8 \
    fp8sk:quantization=fp8,gemm_split_k=1 "$@"
  bench --shapes llama-3.2-1b --options plain:gemm_split_k=0 sk:gemm_split_k=1 "$@"
fi
shopt -s nullglob  # no cache file: no choices to print
python3 - "$BLINK_CACHE_DIR"/gemm/*.json <<'EOF' | tee "$OUT/prefix_step_choices.log"
import json, sys
for path in sys.argv[1:]:  # each tuner's cache: without the variants, and with them (-splitk)
    print(path.rsplit("/", 1)[-1])
    for key, c in sorted(json.load(open(path)).items()):
        if int(key.split(":")[-2].split("x")[0]) <= 256:  # the shapes the variants are for
            print(f"  {key}: {c['default_us']} -> {c['best_us']} µs ({c['described'] or 'own'})")
EOF
