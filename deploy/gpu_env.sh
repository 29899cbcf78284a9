# Sourced by the GPU scripts: installs Blink and the wheels in .device/wheels (those the GPU
# machine lacks: grpcio-health-checking, grpcio-reflection) under /tmp (BLINK_INSTALL_DIR: another
# folder, so two checks can run side by side on a machine of two GPUs) and puts them on the path.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/blink-gpu-out}
mkdir -p "$OUT"
install=${BLINK_INSTALL_DIR:-/tmp}
export PYTHONUNBUFFERED=1 BLINK_CACHE_DIR=${BLINK_CACHE_DIR:-/tmp/blink-cache}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$install/site" .device/wheels/*.whl \
  2>&1 | grep -v WARNING
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target "$install/blink" . \
  2>&1 | grep -v WARNING
export PYTHONPATH=$install/blink:$install/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
