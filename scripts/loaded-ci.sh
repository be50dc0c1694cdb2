#!/usr/bin/env bash
# CI (.ci/run) on a fresh clone of this checkout's HEAD, with busy loops that keep the
# cores busy while ctest runs: the suite must pass on a loaded machine (no test depends on
# wall-clock speed). The loops start when ctest starts and stop when it ends, also when
# the run fails. See docs/development.md, "The suite on a loaded machine".
#
#   scripts/loaded-ci.sh [--loops N] [--dir DIR]
#     --loops N   busy loops during ctest (default 2: one per core of a 2-core machine)
#     --dir DIR   where the clone goes (default: a new temporary folder); its log is
#                 DIR.log, the load every minute DIR.load
#
# Exits with .ci/run's exit code.
set -euo pipefail

loops=2
dir=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --loops) loops="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "loaded-ci.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ "$loops" =~ ^[0-9]+$ ]] || { echo "loaded-ci.sh: --loops wants a count, got '$loops'" >&2; exit 2; }

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ -n "$dir" ]] || dir="$(mktemp -d /tmp/hddp-loaded-ci.XXXXXX)"
rm -rf "$dir"
git clone -q "$repo" "$dir"
log="$dir.log"
load="$dir.load"
echo "$(date +%T) clone of $(git -C "$dir" rev-parse --short HEAD) in $dir; .ci/run starts" | tee "$load"

(cd "$dir" && .ci/run) > "$log" 2>&1 &
ci=$!
pids=()
stop_loops() {
  if [[ ${#pids[@]} -gt 0 ]]; then
    kill "${pids[@]}" 2> /dev/null || true
    wait "${pids[@]}" 2> /dev/null || true
    pids=()
  fi
}
trap 'stop_loops; kill $ci 2> /dev/null || true' EXIT

# ctest prints "Start <n>:" for each test it starts.
until grep -qE "^ +Start +[0-9]+:" "$log" 2> /dev/null || ! kill -0 $ci 2> /dev/null; do
  sleep 5
done
if kill -0 $ci 2> /dev/null; then
  for ((i = 0; i < loops; i++)); do
    bash -c 'while :; do :; done' &
    pids+=($!)
  done
  echo "$(date +%T) ctest started; $loops busy loop(s) on" | tee -a "$load"
  while kill -0 $ci 2> /dev/null && ! grep -qE "tests passed|tests failed" "$log"; do
    sleep 60
    echo "$(date +%T) $(uptime | sed 's/.*load/load/')" >> "$load"
  done
  stop_loops
  echo "$(date +%T) ctest ended; loops off" | tee -a "$load"
fi
rc=0
wait $ci || rc=$?
trap - EXIT
grep -E "tests passed|tests failed|Total Test time" "$log" | tee -a "$load" || true
echo "$(date +%T) .ci/run ended with $rc (log: $log)" | tee -a "$load"
exit $rc
