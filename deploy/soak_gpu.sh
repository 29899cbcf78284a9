#!/usr/bin/env bash
# The saturation soak on the H200 (issue 8): the Llama-3.2-1B shape (random bf16 weights), 256
# closed-loop streams with 10% client cancels and 10% deadlines for SOAK_SECONDS (default 570:
# one lent-machine command may run 10 minutes, start-up included), then the leak check: every KV
# block free, no slot in use. Summary on stdout, JSON in $OUT/soak.json; exit 1 on any error.
#   deploy/soak_gpu.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
python3 -m blink.client.cli soak --shape "${SOAK_SHAPE:-llama-3.2-1b}" \
  --duration "${SOAK_SECONDS:-570}" --concurrency 256 --max-prompt 1024 --max-output 512 \
  --max-model-len 4096 --engine-arg=--max-num-seqs=256 --engine-arg=--max-batched-tokens=2048 \
  --out "$OUT/soak.json" 2>&1 | tee "$OUT/soak.log"
exit "${PIPESTATUS[0]}"
