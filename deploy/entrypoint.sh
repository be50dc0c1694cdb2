#!/usr/bin/env bash
# The hddp image's entry command in a pod of a Kubeflow PyTorchJob (kubeflow.org/v1):
#
#   entrypoint.sh [TRAINER] [TRAINER ARGS...]
#
# It runs `torchrun --no-python TRAINER ARGS...`. TRAINER is train_resnet when the first
# argument is missing or starts with '-'. A bare name is looked up in $HDDP_BIN (default:
# the folder of this script, /opt/hddp/bin in the image), then on PATH; a name with a '/'
# is a path.
#
# torchrun reads its settings from the PET_* variables the training operator sets in
# each pod: PET_X is the default of torchrun's --x flag (torch/distributed/argparse_util.py,
# action `env`). So this script passes none of them again; it checks them first and says
# what is missing, instead of leaving torchrun to wait on a wrong rendezvous.
#   - Always: PET_NNODES (N, or MIN:MAX with elasticPolicy) and PET_NPROC_PER_NODE
#     (spec.nprocPerNode, default "auto").
#   - Elastic job (spec.elasticPolicy): PET_RDZV_ENDPOINT (<job>-worker-0:23456 unless
#     rdzvHost/rdzvPort say otherwise) and PET_RDZV_BACKEND (c10d); when set in the
#     policy also PET_MAX_RESTARTS, PET_RDZV_ID, PET_RDZV_CONF, PET_STANDALONE.
#   - Job with a Master replica: PET_MASTER_ADDR, PET_MASTER_PORT and PET_NODE_RANK
#     (plus MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK, which torchrun sets anew for
#     each worker).
#   - A single pod (PET_NNODES=1) needs no rendezvous variables.
# deploy/README.md explains them.
#
# Environment of this script:
#   HDDP_TORCHRUN  the torchrun to run (default: torchrun on PATH).
#   HDDP_BIN       where bare trainer names are looked up first.
#
# Exit codes: torchrun's (it replaces this shell, so it gets the pod's SIGTERM), or 2
# with a message that names the variable or the trainer when the pod cannot start.
set -euo pipefail

die() {
  echo "hddp-entrypoint: error: $*" >&2
  exit 2
}
say() { echo "hddp-entrypoint: $*" >&2; }

# The operator's variables.
need() {
  local name=$1 why=$2
  [ -n "${!name:-}" ] || die "$name is not set ($why). Is this pod started by Kubeflow's training operator from a PyTorchJob? deploy/README.md lists the variables."
}
need PET_NNODES "the number of pods, N or MIN:MAX"
need PET_NPROC_PER_NODE "ranks per pod: spec.nprocPerNode"

if [[ ! $PET_NNODES =~ ^([0-9]+)(:([0-9]+))?$ ]]; then
  die "PET_NNODES='$PET_NNODES' is not N or MIN:MAX"
fi
min_nodes=${BASH_REMATCH[1]}
max_nodes=${BASH_REMATCH[3]:-$min_nodes}
if [ "$min_nodes" -lt 1 ] || [ "$max_nodes" -lt "$min_nodes" ]; then
  die "PET_NNODES='$PET_NNODES': need 1 <= MIN <= MAX"
fi
case $PET_NPROC_PER_NODE in
  auto | gpu | cpu) ;;
  *) [[ $PET_NPROC_PER_NODE =~ ^[1-9][0-9]*$ ]] ||
    die "PET_NPROC_PER_NODE='$PET_NPROC_PER_NODE' is not a positive number, auto, gpu or cpu (spec.nprocPerNode)" ;;
esac

if [ -n "${PET_STANDALONE+set}" ]; then
  # The operator sets PET_STANDALONE to "" for standalone: true, which torchrun cannot
  # read (it parses the value as an integer); "" means on.
  [ -n "$PET_STANDALONE" ] || export PET_STANDALONE=1
fi

if [ "${PET_STANDALONE:-0}" != 0 ]; then
  mode="standalone (one pod, its own rendezvous)"
elif [ -n "${PET_RDZV_ENDPOINT:-}" ]; then
  need PET_RDZV_BACKEND "the rendezvous backend: elasticPolicy.rdzvBackend"
  [[ $PET_RDZV_ENDPOINT =~ ^.+:[0-9]+$ ]] || die "PET_RDZV_ENDPOINT='$PET_RDZV_ENDPOINT' is not HOST:PORT"
  mode="elastic, rendezvous $PET_RDZV_BACKEND at $PET_RDZV_ENDPOINT"
elif [ -n "${PET_MASTER_ADDR:-}" ] || [ -n "${PET_NODE_RANK:-}" ]; then
  need PET_MASTER_ADDR "the Master pod's address"
  need PET_MASTER_PORT "the Master pod's port"
  need PET_NODE_RANK "this pod's rank among the pods"
  if [ "$min_nodes" != "$max_nodes" ]; then
    die "PET_NNODES='$PET_NNODES' is a range, but a job without elasticPolicy has a fixed number of pods"
  fi
  mode="static, pod $PET_NODE_RANK of $min_nodes, master $PET_MASTER_ADDR:$PET_MASTER_PORT"
elif [ "$max_nodes" = 1 ]; then
  mode="one pod"
else
  die "PET_NNODES='$PET_NNODES' asks for several pods but there is no rendezvous: PET_RDZV_ENDPOINT (spec.elasticPolicy) and PET_MASTER_ADDR (a Master replica) are both unset"
fi

# The trainer and its arguments.
trainer=train_resnet
if [ $# -gt 0 ] && [ -n "$1" ] && [ "${1#-}" = "$1" ]; then
  trainer=$1
  shift
fi
bin_dir=${HDDP_BIN:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
if [ "${trainer#*/}" != "$trainer" ]; then
  program=$trainer
elif [ -x "$bin_dir/$trainer" ] && [ -f "$bin_dir/$trainer" ]; then
  program=$bin_dir/$trainer
else
  program=$(command -v -- "$trainer" 2>/dev/null || true)
fi
if [ -z "$program" ] || [ ! -f "$program" ] || [ ! -x "$program" ]; then
  die "trainer '$trainer' not found (looked in $bin_dir and on PATH); name one of hddp's trainers, e.g. train_resnet or train_unet, as the first of the container's args"
fi

torchrun=${HDDP_TORCHRUN:-torchrun}
if ! command -v -- "$torchrun" >/dev/null 2>&1; then
  die "torchrun not found ('$torchrun'); the image has it in /opt/hddp-venv/bin, or set HDDP_TORCHRUN"
fi

# torch 2.11's agents set up the ranks' shared store once, in their first rendezvous
# round; a pod that joins a later round (the job grows back) waits for its address
# forever. A store per round instead, hosted by rank 0 (docs/cluster.md).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

say "torchrun --no-python $program: $PET_NNODES pod(s) x $PET_NPROC_PER_NODE rank(s), $mode, max restarts ${PET_MAX_RESTARTS:-0}"
exec "$torchrun" --no-python "$program" "$@"
