#!/usr/bin/env bash
# The whole test suite from nothing: setup (only what is missing), build, ctest, then the
# fuzz targets (scripts/fuzz.sh: every kept input of fuzz/regressions/ replayed, then each
# target for HDDP_FUZZ_SECONDS, default 30; 0 skips them; docs/development.md, "Fuzzing").
# This is the command README.md gives and .ci/run calls. Arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
export HDDP_PYTHON=${HDDP_PYTHON:-$(scripts/setup.sh)}
BUILD=$(scripts/build.sh)
(cd "$BUILD" && ctest --output-on-failure -j "${HDDP_TEST_JOBS:-2}" "$@")
if [ "${HDDP_FUZZ_SECONDS:-30}" != 0 ]; then
  scripts/fuzz.sh --library "$BUILD/src/libhddp.so" "${HDDP_FUZZ_SECONDS:-30}"
fi
