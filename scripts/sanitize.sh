#!/usr/bin/env bash
# Builds hddp and its fast tests with AddressSanitizer and UndefinedBehaviorSanitizer
# (clang, -DHDDP_SANITIZE=ON: cmake/HddpSanitize.cmake) into build-asan/ and runs
# `ctest -L fast` there (the regular expression takes in accel-fast too). Exits 1 when a
# test fails or any process, a test's child included, writes a sanitizer report; 2 on a
# usage or build error. See docs/development.md, "Sanitizers".
#
#   scripts/sanitize.sh [options] [-- more ctest arguments]
#     --build-dir DIR   where the sanitized build lives (default build-asan)
#     --no-build        run what DIR holds
#     -R REGEX          only the fast tests whose name matches (ctest -R)
#     -j N              ctest jobs (default 2)
#
# Environment: HDDP_JOBS (build jobs, default 2), HDDP_BUILD_LOCK (a file: the build runs
# under flock on it), HDDP_PYTHON (the Python with torch; default: scripts/setup.sh's).
# ASAN_OPTIONS, UBSAN_OPTIONS and LSAN_OPTIONS from the caller are appended to the ones
# set here (a later option wins).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$repo/build-asan"
do_build=1
filter=""
jobs=2
ctest_extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) build="$(realpath -m "$2")"; shift 2 ;;
    --no-build) do_build=0; shift ;;
    -R) filter="$2"; shift 2 ;;
    -j) jobs="$2"; shift 2 ;;
    --) shift; ctest_extra=("$@"); break ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "sanitize.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

locked() {
  if [[ -n "${HDDP_BUILD_LOCK:-}" ]]; then flock "$HDDP_BUILD_LOCK" "$@"; else "$@"; fi
}

# The executables the fast tests run: hddp_tests (which depends on hddp-run, hddp-probe
# and hddp_test_worker, the programs its tests start), hddp_emu_tests, and the benchmark
# tests/emu/zero_memory_test.py runs under hddp-run.
targets=(hddp_tests hddp_emu_tests zero_memory_bench)

start=$SECONDS
if [[ $do_build == 1 ]]; then
  if ! command -v "${CXX:-clang++}" >/dev/null; then
    echo "sanitize.sh: ${CXX:-clang++} not found: apt-get install clang" >&2
    exit 2
  fi
  if [[ ! -f "$build/CMakeCache.txt" ]]; then
    python="${HDDP_PYTHON:-$("$repo/scripts/setup.sh")}"
    torch_prefix="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
    # No ccache: instrumented objects are large and would push the ordinary build's out
    # of the shared cache; ninja rebuilds only what changed anyway.
    CC="${CC:-clang}" CXX="${CXX:-clang++}" locked cmake -S "$repo" -B "$build" -G Ninja \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$torch_prefix" \
      -DHDDP_PYTHON="$python" -DHDDP_SANITIZE=ON -DHDDP_USE_CCACHE=OFF || exit 2
  fi
fi
if ! grep -q '^HDDP_SANITIZE:BOOL=ON' "$build/CMakeCache.txt" 2>/dev/null; then
  echo "sanitize.sh: $build is not a sanitized build (HDDP_SANITIZE=ON); give another" \
       "--build-dir or remove it" >&2
  exit 2
fi
if [[ $do_build == 1 ]]; then
  locked nice -n 10 cmake --build "$build" -j "${HDDP_JOBS:-2}" --target "${targets[@]}" || exit 2
fi
build_s=$((SECONDS - start))

# Every report goes to a file of its own in $reports (log_path; log_exe_name adds the
# program's name), whichever process wrote it: a test's child whose failure the test
# expects still counts. The variables reach the children: the tests and hddp-run pass
# their environment on (tests/emu/zero_memory_test.py, which builds one, copies these).
reports="$build/sanitizer-reports"
rm -rf "$reports"
mkdir -p "$reports"
supp="$repo/tests/sanitizers"
symbolizer="$(command -v llvm-symbolizer || true)"
common="log_path=$reports/report:log_exe_name=1${symbolizer:+:external_symbolizer_path=$symbolizer}"
# detect_leaks: LeakSanitizer at exit, LibTorch's own leaks suppressed (lsan.supp).
# check_initialization_order: a global's initializer that reads another file's global
# before it is initialized.
export ASAN_OPTIONS="$common:detect_leaks=1:check_initialization_order=1:detect_stack_use_after_return=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
export UBSAN_OPTIONS="$common:print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"

start=$SECONDS
rc=0
ctest --test-dir "$build" -L fast -j "$jobs" --output-on-failure ${filter:+-R "$filter"} \
  "${ctest_extra[@]}" || rc=$?
test_s=$((SECONDS - start))

echo
echo "sanitize.sh: build ${build_s} s, tests ${test_s} s ($(date -u +%Y-%m-%d), $(nproc) cores)"
mapfile -t found < <(find "$reports" -type f | sort)
if [[ ${#found[@]} -gt 0 ]]; then
  echo "sanitize.sh: ${#found[@]} sanitizer report(s) in $reports:" >&2
  for f in "${found[@]}"; do
    echo "  $(basename "$f"): $(grep -a -m1 -E 'ERROR: |runtime error:|SUMMARY:' "$f" || head -1 "$f")" >&2
  done
  exit 1
fi
if [[ $rc != 0 ]]; then
  echo "sanitize.sh: ctest failed (rc $rc) without a sanitizer report" >&2
  exit 1
fi
echo "sanitize.sh: clean"
