#!/usr/bin/env bash
# scripts/main.sh uses what the machine has: one rank per GPU, else 2 CPU ranks.
set -u
source "$(dirname "$0")/../../scripts/lib/main-plan.sh"
fail=0
expect() {  # expect WHAT GOT WANT
  if [ "$2" != "$3" ]; then
    echo "FAIL: $1: got '$2', want '$3'"
    fail=1
  else
    echo "ok: $1: $2"
  fi
}
expect "no GPU" "$(main_launch_args 0)" "--nproc-per-node 2 --devices cpu,cpu"
expect "one GPU" "$(main_launch_args 1)" "--nproc-per-node 1"
expect "four GPUs" "$(main_launch_args 4)" "--nproc-per-node 4"
expect "not a number" "$(main_launch_args abc 2>&1)" "main.sh: 'abc' is not a number of GPUs"
expect "override" "$(HDDP_MAIN_GPUS=3 main_gpu_count)" "3"
expect "describe" "$(main_describe 1)" "main job: 1 GPU rank(s), one per visible CUDA device (NCCL)"
# This machine's count comes from torch and is a number.
count=$(main_gpu_count)
case "$count" in '' | *[!0-9]*) echo "FAIL: main_gpu_count gave '$count'"; fail=1 ;; *) echo "ok: this machine: $count GPU(s)" ;; esac
exit $fail
