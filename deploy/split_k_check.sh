#!/usr/bin/env bash
# Whether the GEMM tuner's split-K variants (Cublas.split_k, `blink serve --gemm-split-k`) pay,
# in one command on the lent H200 (about six minutes): every candidate and its variants against
# float64 (bf16 and FP8), the tuner's own test, then on Llama-3.1-8B and Llama-3.2-1B the steps
# cuBLAS runs at few rows (64 and 128 decodes; a warm prefix request's 100-token and 52-token
# chunks at 2,100 keys, issue 44's step) with the variants and without, bf16 and FP8, twice in
# opposite orders; last, each tuner's choices for those shapes, from its cache.
#   deploy/split_k_check.sh [bench_decode args]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout "${BLINK_TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_cuda_forward.py tests/test_cuda_fp8.py \
  -k "every_candidate or test_cublas_linear_fp8 or gemm_tuner" 2>&1 | tee "$OUT/split_k_tests.log"
[ $# -gt 0 ] || set -- --points 64x512 128x512 --prefill 100x2100 52x2100
for order in "splitk:gemm_split_k=1 plain:gemm_split_k=0" \
             "plain:gemm_split_k=0 splitk:gemm_split_k=1"; do
  fp8order=$(sed 's/:/:quantization=fp8,/g; s/\([a-z]*\):/fp8\1:/g' <<< "$order")
  # shellcheck disable=SC2086  # the variants are words
  timeout "${BLINK_DECODE_TIMEOUT:-280}" python3 -m blink.gpu_engine.bench_decode --no-bf16 \
    --shapes llama-3.1-8b llama-3.2-1b --options $order $fp8order "$@" \
    2>&1 | tee -a "$OUT/split_k_bench.log"
done
python3 - "$BLINK_CACHE_DIR"/gemm/*.json <<'EOF' | tee "$OUT/split_k_choices.log"
import json, sys
for path in sys.argv[1:]:  # each tuner's cache: without the variants, and with them (-splitk)
    print(path.rsplit("/", 1)[-1])
    for key, c in sorted(json.load(open(path)).items()):
        if int(key.split(":")[-2].split("x")[0]) <= 256:  # the shapes the variants are for
            print(f"  {key}: {c['default_us']} -> {c['best_us']} µs ({c['described'] or 'own'})")
EOF
