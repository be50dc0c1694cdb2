#!/usr/bin/env bash
# GPU check, for a machine with CUDA and a PyTorch install but no package access.
#
#   shared/tools/device-pack.sh          # on a Debian machine: bundles spdlog, fmt, CLI11,
#                                        # json, stb, GoogleTest into .device-deps/
#   tools/gpu-check.sh OUT_DIR           # on the GPU machine, from the repository root
#
# Configures against that machine's own torch (torch.utils.cmake_prefix_path) with the
# bundled dependencies, builds, runs the *_CUDA tests, then the rest of the suite, then
# the GPU benchmarks (bench/gpu-*.sh), writing every log to OUT_DIR. Sized for a
# 10-minute slot on a 16-core machine; each step has its own time limit and a failing
# step does not stop the later ones. Exit status: non-zero if any step failed.
set -uo pipefail
OUT=${1:?usage: tools/gpu-check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${HDDP_PYTHON:-python3}
DEPS=${HDDP_DEVICE_DEPS:-$PWD/.device-deps}
BUILD=${HDDP_BUILD_DIR:-build-gpu}
# Fashion-MNIST carried along (cp -r /usr/share/datasets/fashion-mnist .device-deps/),
# for bench/gpu-trainers.sh, bench/gpu-mixed.sh and scripts/main.sh.
if [ -z "${HDDP_FASHION_MNIST:-}" ] && [ -d "$DEPS/fashion-mnist" ]; then
  export HDDP_FASHION_MNIST="$DEPS/fashion-mnist"
fi
JOBS=${HDDP_JOBS:-$(nproc)}
status=0
step() {  # step NAME SECONDS command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
  return $rc
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "nccl", torch.cuda.nccl.version(), "devices", torch.cuda.device_count())' 2>&1
} > "$OUT/machine.txt"
cat "$OUT/machine.txt"

TORCH_PREFIX=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
GEN=$(command -v ninja >/dev/null && echo Ninja || echo "Unix Makefiles")
step configure 300 cmake -S . -B "$BUILD" -G "$GEN" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DHDDP_PYTHON="$PY" -DHDDP_DEVICE_DEPS="$DEPS" \
  -DHDDP_WITH_CUDA=ON -DHDDP_USE_CCACHE=OFF \
  && step build 420 cmake --build "$BUILD" -j "$JOBS"
if [ -x "$BUILD/tests/hddp_tests" ]; then
  # Every *_CUDA test, by name. The Nccl.*Stuck*_CUDA pair (issue #36) each start a child
  # process whose collective cannot complete: ~10 s each, at most 60 s when c10d fails to
  # end it, hence 240 s here.
  step cuda-tests 240 "$BUILD/tests/hddp_tests" --gtest_filter='*_CUDA*' --gtest_brief=0
  # The elastic rejoin check of a CUDA slot: exit 0 for a device that answers, 1 for none.
  step check-device 60 bash -c "'$BUILD/tools/hddp-probe/hddp-probe' --check-device cuda:0 &&
    '$BUILD/tools/hddp-probe/hddp-probe' --check-device slot:0 &&
    ! '$BUILD/tools/hddp-probe/hddp-probe' --check-device cuda:7"
  # What-if calibrated on this card (the table's h200): the measured ResNet-50 step and
  # the prediction it gives; the log shows the efficiency the card reaches.
  step what-if 120 bash -c "'$BUILD/tools/hddp-probe/hddp-probe' --what-if h200@pcie5x16,rtx4090@tb3 \
    --model resnet50 --amp bf16 --calibrate h200 --calibrate-device cuda:0 \
    --save-profile '$OUT/resnet50-h200-profile.json' --svg '$OUT/what-if.svg' | tee '$OUT/what-if.txt'"
  step all-tests 240 bash -c "cd '$BUILD' && ctest --output-on-failure -j 8 -E 'package\\.'"
fi
for b in bench/gpu-*.sh; do
  [ -e "$b" ] || continue
  step "$(basename "$b" .sh)" 480 bash "$b" "$BUILD" "$OUT"
done
cat "$OUT/summary.txt"
exit $status
