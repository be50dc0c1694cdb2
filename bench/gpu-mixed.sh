#!/usr/bin/env bash
# Unlike devices in one job (run by tools/gpu-check.sh): ResNet-20 on Fashion-MNIST
# (synthetic 28x28 when absent) for 1 epoch, first on the GPU rank alone, then on a GPU
# rank and a CPU rank together (hddp-run --devices cuda:0,cpu: Gloo for the job, the
# planner splitting each global batch). Then scripts/main.sh as a newcomer runs it (one
# rank per GPU, NCCL). Prints the split the planner settled on, global samples/s
# against the GPU alone, and the test accuracies; metrics go to OUT_DIR.
#   bench/gpu-mixed.sh BUILD_DIR OUT_DIR
set -uo pipefail
BUILD=${1:?usage: bench/gpu-mixed.sh BUILD_DIR OUT_DIR}
OUT=${2:?usage: bench/gpu-mixed.sh BUILD_DIR OUT_DIR}
PY=${HDDP_PYTHON:-python3}
RUN="$BUILD/tools/hddp-run/hddp-run"
R="$BUILD/examples/resnet/train_resnet"
source "$(dirname "$0")/lib/fashion-mnist.sh"
JOB=(--model resnet20 "${DATA[@]}" --epochs 1 --global-batch 128 --lr 0.1 --warmup-epochs 0.1
  --no-augment --workers 2 --progress lines)
status=0
timeout 120 "$RUN" --devices cuda:0 -- "$R" "${JOB[@]}" --metrics "$OUT/mixed-gpu-alone.jsonl" \
  || status=1
timeout 180 "$RUN" --devices cuda:0,cpu -- "$R" "${JOB[@]}" --metrics "$OUT/mixed.jsonl" \
  || status=1
"$PY" - "$OUT" <<'PY' || status=1
import json, sys
out = sys.argv[1]
def records(name):
    try:
        return [json.loads(l) for l in open(f"{out}/{name}") if l.strip()]
    except OSError:
        return []
def kind(rs, k):
    return [r for r in rs if r.get("kind") == k]
alone, mixed = records("mixed-gpu-alone.jsonl"), records("mixed.jsonl")
def rate(rs):  # samples/s over the steps after the first 20 (warm-up, calibration)
    steps = kind(rs, "step")[20:]
    secs = sum(s["step_s"] for s in steps)
    return sum(s["global_batch"] for s in steps) / secs if secs > 0 else float("nan")
def acc(rs):
    ev = kind(rs, "evaluation")
    return ev[-1].get("test_acc", float("nan")) if ev else float("nan")
steps = kind(mixed, "step")
plans = [tuple(s["plan"]) for s in steps]
print(f"mixed job: final split {list(plans[-1]) if plans else '?'} (GPU rank, CPU rank), "
      f"{len(set(plans))} distinct plan(s) over {len(plans)} steps")
a, m = rate(alone), rate(mixed)
print(f"global samples/s after step 20: GPU alone {a:.0f}, GPU+CPU {m:.0f}, ratio {m / a:.3f}")
print(f"test accuracy: GPU alone {acc(alone):.4f}, GPU+CPU {acc(mixed):.4f}")
PY
# The main job as a newcomer runs it, on the build above (no setup, no apt there), with
# its time budget cut from 270 s to 100 s to fit the device slot (it may end sooner, by
# its 15 epochs).
start=$SECONDS
HDDP_PYTHON="$PY" HDDP_BUILD_DIR="$BUILD" timeout 150 scripts/main.sh --time-budget 100 \
  > "$OUT/main-job.log" 2>&1 || status=1
tail -4 "$OUT/main-job.log"
echo "main.sh: $((SECONDS - start)) s in all"
exit $status
