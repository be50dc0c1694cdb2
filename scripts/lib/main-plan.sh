# How the main job (scripts/main.sh) uses the machine; sourced, and tested by
# tests/scripts/main_plan_test.sh.

# CUDA devices the ranks will see (CUDA_VISIBLE_DEVICES applies), 0 without a driver.
# HDDP_MAIN_GPUS overrides it (e.g. HDDP_MAIN_GPUS=0 trains on the CPU of a GPU machine).
main_gpu_count() {
  if [ -n "${HDDP_MAIN_GPUS:-}" ]; then
    echo "$HDDP_MAIN_GPUS"
    return
  fi
  "${HDDP_PYTHON:-python3}" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0
}

# hddp-run's arguments for GPUS visible devices: one rank per GPU (each on
# cuda:<local rank>, NCCL), or 2 CPU ranks (Gloo) when there is none.
main_launch_args() {
  local gpus=$1
  case "$gpus" in
    '' | *[!0-9]*) echo "main.sh: '$gpus' is not a number of GPUs" >&2; return 2 ;;
  esac
  if [ "$gpus" -gt 0 ]; then
    echo "--nproc-per-node $gpus"
  else
    echo "--nproc-per-node 2 --devices cpu,cpu"
  fi
}

# One line for the log: what the job runs on.
main_describe() {
  local gpus=$1
  if [ "$gpus" -gt 0 ]; then
    echo "main job: $gpus GPU rank(s), one per visible CUDA device (NCCL)"
  else
    echo "main job: 2 CPU ranks (Gloo); no CUDA device is visible"
  fi
}
