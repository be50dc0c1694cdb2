#!/usr/bin/env bash
# Installs what hddp needs on Debian 12, only what is missing (idempotent):
#   - Debian packages: compilers and tools, spdlog, fmt, CLI11, nlohmann-json, stb, zlib,
#     libpng and libjpeg-turbo (PNG and JPEG decoding),
#     GoogleTest, protobuf (TensorBoard's event files), ccache, Ninja, Fashion-MNIST, Slurm and MUNGE (the engines test),
#     clang with its runtimes (libFuzzer and the sanitizers: the fuzz targets, scripts/fuzz.sh);
#   - the torch wheel (LibTorch, pinned to the GPU machine's 2.11.0) in a virtual
#     environment outside the repository, $HDDP_VENV (default /opt/hddp-venv).
# Prints the Python to use. Safe to run again; does nothing when all is there.
set -euo pipefail

TORCH_VERSION=${HDDP_TORCH_VERSION:-2.11.0}
MATPLOTLIB_VERSION=3.9.2
PYYAML_VERSION=6.0.3
SAFETENSORS_VERSION=0.8.0
TORCHVISION_VERSION=0.26.0  # the release that goes with torch 2.11.0
TENSORBOARD_VERSION=2.21.0
VENV=${HDDP_VENV:-/opt/hddp-venv}
APT_PACKAGES=(build-essential cmake ninja-build ccache git python3 python3-venv
  libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev libstb-dev zlib1g-dev
  libpng-dev libjpeg62-turbo-dev
  libgtest-dev libprotobuf-dev protobuf-compiler dataset-fashion-mnist slurmctld slurmd slurm-client munge
  clang libclang-rt-dev)

log() { echo "setup: $*" >&2; }

SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null; then SUDO=sudo; fi
fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q >&2
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
fi

# A Python that can make virtual environments (the image's own python3 may not be Debian's).
PY=${HDDP_BOOTSTRAP_PYTHON:-python3}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  :
else
  log "installing torch==$TORCH_VERSION into $VENV (a CUDA build of LibTorch; a few GB, once per machine)"
  $SUDO mkdir -p "$(dirname "$VENV")"
  [ -x "$VENV/bin/python" ] || $SUDO "$PY" -m venv "$VENV"
  $SUDO "$VENV/bin/pip" install -q --disable-pip-version-check "torch==$TORCH_VERSION" numpy >&2
fi
# matplotlib for hddp-plot and the benchmarks' charts, in the same environment.
if ! "$VENV/bin/python" -c "import matplotlib" 2>/dev/null; then
  log "installing matplotlib==$MATPLOTLIB_VERSION into $VENV (hddp-plot)"
  $SUDO "$VENV/bin/pip" install -q --disable-pip-version-check "matplotlib==$MATPLOTLIB_VERSION" >&2
fi
# PyYAML for the checks of the Kubernetes manifest (tests/engines/pytorchjob_*_test.py).
if ! "$VENV/bin/python" -c "import yaml" 2>/dev/null; then
  log "installing pyyaml==$PYYAML_VERSION into $VENV (the PyTorchJob manifest's tests)"
  $SUDO "$VENV/bin/pip" install -q --disable-pip-version-check "pyyaml==$PYYAML_VERSION" >&2
fi
# safetensors for the state-dict checks against Python (tests/train/state_dict_python_test.py).
if ! "$VENV/bin/python" -c "import safetensors" 2>/dev/null; then
  log "installing safetensors==$SAFETENSORS_VERSION into $VENV (the state-dict checks)"
  $SUDO "$VENV/bin/pip" install -q --disable-pip-version-check "safetensors==$SAFETENSORS_VERSION" >&2
fi
# torchvision for the checks that hddp's ResNets load into torchvision's and back.
if ! "$VENV/bin/python" -c "import torchvision" 2>/dev/null; then
  log "installing torchvision==$TORCHVISION_VERSION into $VENV (the ResNet checks against torchvision)"
  $SUDO "$VENV/bin/pip" install -q --disable-pip-version-check "torchvision==$TORCHVISION_VERSION" "torch==$TORCH_VERSION" >&2
fi
# tensorboard's event reader for the check of --tensorboard's files.
if ! "$VENV/bin/python" -c "import tensorboard" 2>/dev/null; then
  log "installing tensorboard==$TENSORBOARD_VERSION into $VENV (the TensorBoard read-back check)"
  $SUDO "$VENV/bin/pip" install -q --disable-pip-version-check "tensorboard==$TENSORBOARD_VERSION" >&2
fi
echo "$VENV/bin/python"
