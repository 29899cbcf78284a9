#!/usr/bin/env bash
# The whole GPU check in one command, for the lent H200 (or any CUDA 13 machine with nvcc):
# installs Blink and the wheels in .device/wheels into /tmp, runs the GPU test suite and a short
# decode benchmark, prints a summary table last.
#   deploy/gpu_check.sh [pytest args]        (wheels: .device/wheels/, see README)
# BLINK_TEST_TIMEOUT (default 540 s) bounds the tests: the whole suite took 420-490 s on the lent
# H200 (longer where the kernels' build cache is cold), so on a machine that stops a command at
# 600 s set BLINK_SKIP_BENCH=1 for the whole suite and run the benchmark on its own.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import cuda.bindings, grpc, google.protobuf as p; print('cuda-bindings', cuda.bindings.__version__, 'grpc', grpc.__version__, 'protobuf', p.__version__)"
[ $# -gt 0 ] || set -- tests   # pytest arguments, kept whole: -k "a or b" stays one expression
test_timeout=${BLINK_TEST_TIMEOUT:-540}
timeout "$test_timeout" python3 -m pytest -q -rs -m gpu -s -p no:cacheprovider \
  "$@" 2>&1 | tee "$OUT/gpu_tests.log"
status=${PIPESTATUS[0]}
if [ -z "${BLINK_SKIP_BENCH:-}" ]; then
  timeout "${BLINK_BENCH_TIMEOUT:-150}" python3 -m blink.gpu_engine.bench_decode 2>&1 \
    | tee "$OUT/bench.log"
fi
echo
echo "| check | result |"
echo "| --- | --- |"
# (a printed line may follow pytest's progress marks: dots, s for a skip, F for a failure)
grep -hE "^[.sFE]*(device loop|forward|engine|bench)" "$OUT/gpu_tests.log" "$OUT/bench.log" 2>/dev/null \
  | sed -E 's/^[.sFE]*([^:]*): (.*)$/| \1 | \2 |/'
summary=$(grep -E "(passed|failed|error).* in [0-9.]+s" "$OUT/gpu_tests.log" | tail -n 1)
if [ "$status" -eq 124 ] && [ -z "$summary" ]; then  # say so, not an empty row
  echo "| GPU tests | STOPPED after ${test_timeout} s (BLINK_TEST_TIMEOUT) before the end:" \
       "no pytest summary, see $OUT/gpu_tests.log |"
elif [ "$status" -eq 124 ]; then  # the summary came, then the timeout stopped the exit
  echo "| GPU tests | $summary; the process was still exiting at ${test_timeout} s" \
       "(BLINK_TEST_TIMEOUT) and was stopped |"
else
  echo "| GPU tests | ${summary:-$(grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -n 1)} |"
fi
exit "$status"
