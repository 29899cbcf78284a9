#!/usr/bin/env bash
# bench_decode on two builds in one call, alternating, so that a change's timing is read against
# its base on the same machine, clock and power state (docs/performance.md round 35).
#   here:          deploy/ab_decode.sh prepare [REF]   (REF's sources, default HEAD, into
#                  .device/base; carry .device to the GPU machine)
#   GPU machine:   deploy/ab_decode.sh run [bench_decode args]
#                  (AB_ORDER="base new base new" by default; logs in $OUT/ab_base.log, ab_new.log)
set -uo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in
  prepare)
    rm -rf .device/base && mkdir -p .device/base
    git archive "${2:-HEAD}" | tar -x -C .device/base
    echo "base: $(git rev-parse --short "${2:-HEAD}") in .device/base" ;;
  run)
    shift
    if [ ! -d .device/base ]; then
      echo "no .device/base: run 'deploy/ab_decode.sh prepare' here first" >&2
      exit 2
    fi
    source deploy/gpu_env.sh >/dev/null  # the working tree, into $install/blink
    base=${BLINK_INSTALL_DIR:-/tmp}/base
    python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade \
      --target "$base/blink" .device/base 2>&1 | grep -v WARNING
    for v in ${AB_ORDER:-base new base new}; do
      if [ "$v" = base ]; then root=$base/blink; else root=${BLINK_INSTALL_DIR:-/tmp}/blink; fi
      echo "=== $v"
      PYTHONPATH=$root:${BLINK_INSTALL_DIR:-/tmp}/site timeout "${BLINK_DECODE_TIMEOUT:-200}" \
        python3 -m blink.gpu_engine.bench_decode "$@" 2>&1 | tee -a "$OUT/ab_$v.log" \
        | grep "^| "
    done ;;
  *)
    echo "usage: deploy/ab_decode.sh prepare [REF] | run [bench_decode args]" >&2; exit 2 ;;
esac
