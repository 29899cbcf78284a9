#!/usr/bin/env bash
# What is left of a warm prefix request's step (issue 44: 100 own tokens after a cached 2,000-token
# prefix, a 100-token chunk at 2,100 keys; docs/performance.md rounds 34, 36 and 38), on the lent
# H200:
#   part 1 (about five minutes): the chunk's attention as shipped (since round 38 the roomy
#     kernel, the 64-row mma.sync tiles at two CTAs an SM, in buckets of up to 128 tokens),
#     without it (attention_roomy_max_bucket=0: three CTAs an SM), on the wgmma kernel (128-row
#     tiles on two warpgroups: attention_wgmma_min_bucket=65 puts every bucket past the
#     decode-sized ones on it) and with the finer buckets below 128 (fine_buckets_from=64: the
#     chunk in a 112-row graph), in two orders, on Llama-3.1-8B bf16, then on 8B FP8 and
#     Llama-3.2-1B (head dim 64, where the roomy kernel is the plain one): the 100- and 52-token
#     chunks, and the 128-row decode step, whose bucket the options move too;
#   part 2 (about four minutes): the live path, bench_serving --suite prefix, with the default
#     buckets and with --fine-buckets-from 64.
# Round 34 timed the GEMM tuner's split-K variants here too (dropped as a default: the chunk's
# projections are power-bound); `bench_decode --options sk:gemm_split_k=1` still does.
#   deploy/prefix_step_check.sh 1 [bench_decode args] | 2 [bench_serving args]
set -uo pipefail
part=${1:-}
case $part in
  1|2) shift ;;
  *) echo "usage: deploy/prefix_step_check.sh 1 [bench_decode args] | 2 [bench_serving args]" >&2
     exit 2 ;;
esac
source "$(dirname "$0")/gpu_env.sh"
if [ "$part" = 2 ]; then
  for flags in "" "--engine-flag=--fine-buckets-from=64"; do
    echo "=== bench_serving --suite prefix $flags"
    # (an empty $flags passes no argument)
    timeout "${BLINK_SERVING_TIMEOUT:-220}" python3 -m blink.client.bench_serving \
      --shapes llama-3.1-8b --suite prefix $flags "$@" 2>&1 | tee -a "$OUT/prefix_serving.log"
  done
  exit
fi
[ $# -gt 0 ] || set -- --points 128x512 --prefill 100x2100 52x2100
bench() {
  timeout "${BLINK_DECODE_TIMEOUT:-150}" python3 -m blink.gpu_engine.bench_decode --no-bf16 \
    "$@" 2>&1 | tee -a "$OUT/prefix_step_bench.log"
}
wg=attention_wgmma_min_bucket=65 noroomy=attention_roomy_max_bucket=0 fine=fine_buckets_from=64
bench --shapes llama-3.1-8b --options shipped:gemm_tuning=1 noroomy:$noroomy wg:$wg fine:$fine "$@"
bench --shapes llama-3.1-8b --options fine:$fine wg:$wg noroomy:$noroomy shipped:gemm_tuning=1 "$@"
bench --shapes llama-3.1-8b --options fp8:quantization=fp8 fp8noroomy:quantization=fp8,$noroomy \
  fp8wg:quantization=fp8,$wg "$@"
bench --shapes llama-3.2-1b --options shipped:gemm_tuning=1 wg:$wg "$@"
