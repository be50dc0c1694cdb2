#!/usr/bin/env bash
# The whole test suite from nothing: setup (only what is missing), build, ctest.
# This is the command README.md gives and .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."
export HDDP_PYTHON=${HDDP_PYTHON:-$(scripts/setup.sh)}
BUILD=$(scripts/build.sh)
cd "$BUILD"
ctest --output-on-failure -j "${HDDP_TEST_JOBS:-2}" "$@"
