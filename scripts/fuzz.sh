#!/usr/bin/env bash
# Builds hddp's fuzz targets (fuzz/: libFuzzer + AddressSanitizer + UndefinedBehaviorSanitizer,
# clang) into build-fuzz/ and runs each for SECONDS (default 30) on its committed corpus.
# Exits 1 when a target finds something (or a kept regression input still fails), 2 on a
# usage or build error. See docs/development.md, "Fuzzing".
#
#   scripts/fuzz.sh [options] [SECONDS]
#     --build-dir DIR   where the targets are built (default build-fuzz)
#     --library PATH    the libhddp.so they link (default $HDDP_BUILD_DIR or build, /src/libhddp.so)
#     --only TARGET     run this target only (repeatable; default: every target of fuzz/targets.cmake)
#     --no-build        run what DIR holds (ctest -L fuzz does this)
#     --keep-going      fork mode: go on after a finding (-fork=1 -ignore_crashes=1 ...) to
#                       collect several; each one still ends up in DIR/findings/<target>/
#
# Environment: CC/CXX (default clang/clang++), HDDP_FUZZ_JOBS (build jobs, default 2),
# HDDP_BUILD_LOCK (a file: builds run under flock on it), HDDP_FUZZ_ARGS (more libFuzzer flags),
# HDDP_FUZZ_ACCEPT_FOREIGN_ERRORS=1 (fuzz/fuzz_support.h: go past unwrapped exceptions).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$repo/build-fuzz"
library="$repo/${HDDP_BUILD_DIR:-build}/src/libhddp.so"
only=()
do_build=1
keep_going=0
seconds=30
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) build="$(realpath -m "$2")"; shift 2 ;;
    --library) library="$(realpath -m "$2")"; shift 2 ;;
    --only) only+=("$2"); shift 2 ;;
    --no-build) do_build=0; shift ;;
    --keep-going) keep_going=1; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    [0-9]*) seconds="$1"; shift ;;
    *) echo "fuzz.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

# The targets, from the one list CMake uses too.
mapfile -t all < <(sed -n '/^set(HDDP_FUZZ_TARGETS/,/)/p' "$repo/fuzz/targets.cmake" |
                   grep -o 'fuzz_[a-z_]*')
if [[ ${#only[@]} -gt 0 ]]; then targets=("${only[@]}"); else targets=("${all[@]}"); fi
for t in "${targets[@]}"; do
  [[ " ${all[*]} " == *" $t "* ]] || { echo "fuzz.sh: no target '$t' (${all[*]})" >&2; exit 2; }
done

locked() {
  if [[ -n "${HDDP_BUILD_LOCK:-}" ]]; then flock "$HDDP_BUILD_LOCK" "$@"; else "$@"; fi
}

if [[ $do_build == 1 ]]; then
  if [[ ! -f "$library" ]]; then
    echo "fuzz.sh: $library is missing: build libhddp first (cmake --build build --target hddp)" >&2
    exit 2
  fi
  if ! command -v "${CXX:-clang++}" >/dev/null; then
    echo "fuzz.sh: ${CXX:-clang++} not found: apt-get install clang (libFuzzer ships with it)" >&2
    exit 2
  fi
  if [[ ! -f "$build/CMakeCache.txt" ]]; then
    generator=()
    command -v ninja >/dev/null && generator=(-G Ninja)
    CC="${CC:-clang}" CXX="${CXX:-clang++}" locked cmake -S "$repo/fuzz" -B "$build" \
      "${generator[@]}" -DHDDP_LIBRARY="$library" ${HDDP_PYTHON:+-DHDDP_PYTHON="$HDDP_PYTHON"} ||
      exit 2
  fi
  locked cmake --build "$build" -j "${HDDP_FUZZ_JOBS:-2}" --target "${targets[@]}" || exit 2
fi

# A sanitizer report ends the run with a stack; UBSan's too (the targets are built with
# -fno-sanitize-recover=undefined).
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$repo/fuzz/lsan.supp:print_suppressions=0}"
export HDDP_LOG_LEVEL="${HDDP_LOG_LEVEL:-off}"
# The targets' scratch folders (fuzz_support.h), on tmpfs where there is one; a target
# that crashes leaves its own behind, so the whole is removed at the end.
HDDP_FUZZ_TMP="$(mktemp -d /dev/shm/hddp-fuzz.XXXXXX 2>/dev/null || mktemp -d)"
export HDDP_FUZZ_TMP
trap 'rm -rf "$HDDP_FUZZ_TMP"' EXIT
common=(-rss_limit_mb=2048 -timeout=10 -print_final_stats=1 -print_funcs=0)
# shellcheck disable=SC2206
extra=(${HDDP_FUZZ_ARGS:-})
if [[ $keep_going == 1 ]]; then
  extra+=(-fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1)
fi

failed=0
summary=()
for t in "${targets[@]}"; do
  bin="$build/$t"
  [[ -x "$bin" ]] || { echo "fuzz.sh: $bin is not built" >&2; exit 2; }
  findings="$build/findings/$t"
  work="$build/corpus/$t"
  log="$build/logs/$t.log"
  if compgen -G "$findings/*" >/dev/null; then  # the previous run's, kept once
    rm -rf "$findings.previous" && mv "$findings" "$findings.previous"
  fi
  mkdir -p "$findings" "$work" "$(dirname "$log")"
  result="ok"
  # The inputs kept from earlier findings (fuzz/regressions/<target>/) must pass first.
  regressions="$repo/fuzz/regressions/$t"
  if compgen -G "$regressions/*" >/dev/null; then
    for input in "$regressions"/*; do
      if ! "$bin" "${common[@]}" "$input" >"$log.regression" 2>&1; then
        echo "fuzz.sh: $t fails on the kept input $input (see $log.regression)" >&2
        result="regression fails"
        failed=1
      fi
    done
  fi
  # LibTorch's zip reader leaks on each file it refuses (fuzz/lsan.supp), and a leak makes
  # libFuzzer run a whole LeakSanitizer pass for that input: 150 inputs/s instead of 7,000.
  # The targets whose inputs go through it run without leak checks; HDDP_FUZZ_ARGS may
  # put them back (-detect_leaks=1).
  own=()
  case "$t" in fuzz_state_dict_pt|fuzz_state_file) own=(-detect_leaks=0) ;; esac
  echo "== $t: ${seconds}s (log: $log)"
  rc=0
  (cd "$findings" && "$bin" "${common[@]}" "${own[@]}" "${extra[@]}" -max_total_time="$seconds" \
     -artifact_prefix="$findings/" "$work" "$repo/fuzz/corpus/$t") >"$log" 2>&1 || rc=$?
  if [[ $rc != 0 ]] || compgen -G "$findings/crash-*" >/dev/null ||
     compgen -G "$findings/leak-*" >/dev/null || compgen -G "$findings/timeout-*" >/dev/null ||
     compgen -G "$findings/oom-*" >/dev/null; then
    result="FINDING (rc $rc): $(ls "$findings" | head -3 | tr '\n' ' ')"
    grep -a -m3 -E "ERROR:|FINDING|runtime error" "$log" | sed 's/^/    /' || true
    failed=1
  fi
  # The last status line: "#N <what> cov: C ft: F corp: ... exec/s: E" (fork mode: "#N: cov: ...").
  status="$(grep -a -E '^#[0-9]+:?[[:space:]]' "$log" | grep -a 'cov:' | tail -1 || true)"
  runs="$(sed -E 's/^#([0-9]+).*/\1/' <<<"$status" || true)"
  cov="$(grep -o 'cov: [0-9]*' <<<"$status" | grep -o '[0-9]*' || echo '?')"
  ft="$(grep -o 'ft: [0-9]*' <<<"$status" | grep -o '[0-9]*' || echo '?')"
  rate="$(grep -o 'exec/s:\? [0-9]*' <<<"$status" | grep -o '[0-9]*$' || echo '?')"
  summary+=("$(printf '%-28s %9s runs %7s exec/s  cov %5s  ft %6s  %s' "$t" "${runs:-?}" \
               "${rate:-?}" "$cov" "$ft" "$result")")
done

echo
echo "fuzz.sh: ${seconds}s per target, $(date -u +%Y-%m-%d), $(uname -m), $(nproc) cores"
printf '%s\n' "${summary[@]}"
if [[ $failed != 0 ]]; then
  echo "fuzz.sh: findings above; inputs under $build/findings/<target>/ (keep each under" \
       "fuzz/regressions/<target>/ once understood)" >&2
  exit 1
fi
