#!/usr/bin/env bash
# GPU benchmark run by tools/gpu-check.sh: activation checkpointing peak memory (max
# allocated) and time per step on CUDA. Goal: peak activation memory down >= 40% for
# <= 35% more time per step. Usage: bench/gpu-checkpoint.sh BUILD_DIR OUT_DIR
set -euo pipefail
BUILD=$1
OUT=$2
PY=${HDDP_PYTHON:-python3}
"$PY" "$(dirname "$0")/checkpoint_compare.py" --build "$BUILD" --device cuda --models resnet18 resnet50 unet \
  --batch 128 --steps 5 --json "$OUT/gpu-checkpoint.json"
