#!/usr/bin/env bash
# The main job from nothing: setup (only what is missing), build, run.
# For now: hddp's communicator against PyTorch's torch.distributed Gloo, 2 CPU ranks
# launched by hddp-run, allreduce bus bandwidth per message size and the ratio.
# (The example trainers replace this when they land; the command stays the same.)
set -euo pipefail
cd "$(dirname "$0")/.."
export HDDP_PYTHON=${HDDP_PYTHON:-$(scripts/setup.sh)}
BUILD=$(scripts/build.sh)
exec "$HDDP_PYTHON" bench/allreduce_compare.py --build "$BUILD" --nproc 2 "$@"
