#!/usr/bin/env bash
# Configures and builds hddp into $HDDP_BUILD_DIR (default build/) with Ninja, ccache
# when installed, and 2 jobs (the project's machines have 2 cores; set HDDP_JOBS).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${HDDP_PYTHON:-$(scripts/setup.sh)}
BUILD=${HDDP_BUILD_DIR:-build}
TORCH_PREFIX=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=${HDDP_BUILD_TYPE:-RelWithDebInfo} \
    -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DHDDP_PYTHON="$PYTHON" ${HDDP_CMAKE_ARGS:-} >&2
fi
cmake --build "$BUILD" -j "${HDDP_JOBS:-2}" >&2
echo "$BUILD"
