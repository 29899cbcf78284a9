#!/usr/bin/env bash
# The whole GPU check in one command, for the lent H200 (or any CUDA 13 machine with nvcc):
# installs Blink and the wheels in .device/wheels into /tmp, runs the GPU test suite and a short
# decode benchmark, prints a summary table last.
#   deploy/gpu_check.sh [pytest args]        (wheels: .device/wheels/, see README)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/blink-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 BLINK_CACHE_DIR=${BLINK_CACHE_DIR:-/tmp/blink-cache}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .device/wheels/*.whl \
  2>&1 | grep -v WARNING
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/blink . \
  2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/blink:/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import cuda.bindings, grpc, google.protobuf as p; print('cuda-bindings', cuda.bindings.__version__, 'grpc', grpc.__version__, 'protobuf', p.__version__)"
TESTS=${*:-tests}
timeout "${BLINK_TEST_TIMEOUT:-420}" python3 -m pytest -q -rs -m gpu -s -p no:cacheprovider \
  $TESTS 2>&1 | tee "$OUT/gpu_tests.log"
status=${PIPESTATUS[0]}
if [ -z "${BLINK_SKIP_BENCH:-}" ]; then
  timeout "${BLINK_BENCH_TIMEOUT:-150}" python3 -m blink.gpu_engine.bench_decode 2>&1 \
    | tee "$OUT/bench.log"
fi
echo
echo "| check | result |"
echo "| --- | --- |"
grep -hE "^(device loop|forward|engine|bench)" "$OUT/gpu_tests.log" "$OUT/bench.log" 2>/dev/null \
  | sed -E 's/^([^:]*): (.*)$/| \1 | \2 |/'
echo "| GPU tests | $(grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -n 1) |"
exit "$status"
