#!/usr/bin/env bash
# The example trainers on one CUDA device (run by tools/gpu-check.sh): ResNet-20 on
# Fashion-MNIST for 2 epochs with fp16 (GradScaler) and bf16 autocast, ResNet-18 with
# activation checkpointing, and the U-Net on synthetic shapes. Each prints its test
# metrics; the metrics files go to OUT_DIR.
#   bench/gpu-trainers.sh BUILD_DIR OUT_DIR
set -euo pipefail
BUILD=${1:?usage: bench/gpu-trainers.sh BUILD_DIR OUT_DIR}
OUT=${2:?usage: bench/gpu-trainers.sh BUILD_DIR OUT_DIR}
R="$BUILD/examples/resnet/train_resnet"
U="$BUILD/examples/unet/train_unet"
source "$(dirname "$0")/lib/fashion-mnist.sh"
COMMON=(--progress lines --workers 4 --threads 4)
"$R" "${DATA[@]}" "${COMMON[@]}" --epochs 2 --amp fp16 --metrics "$OUT/resnet20-fp16.jsonl"
"$R" "${DATA[@]}" "${COMMON[@]}" --epochs 2 --amp bf16 --metrics "$OUT/resnet20-bf16.jsonl"
"$R" "${DATA[@]}" "${COMMON[@]}" --model resnet18 --max-steps 200 --amp bf16 \
  --checkpoint-activations --metrics "$OUT/resnet18-ckpt.jsonl"
"$U" "${COMMON[@]}" --epochs 3 --amp bf16 --checkpoint-activations --metrics "$OUT/unet.jsonl"
