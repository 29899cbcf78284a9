#!/usr/bin/env bash
# The whole GPU check in one command, for the lent H200 (or any CUDA 13 machine with nvcc):
# installs Blink and PyCUDA wheels into /tmp, runs the GPU test suite, prints a summary last.
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
python3 -m pytest -q -rs -m gpu -s -p no:cacheprovider "$@" tests 2>&1 | tee "$OUT/gpu_tests.log"
status=${PIPESTATUS[0]}
echo "== summary =="
grep -E "^(device loop|forward|engine|bench|decode)" "$OUT/gpu_tests.log" || true
tail -n 3 "$OUT/gpu_tests.log"
exit "$status"
