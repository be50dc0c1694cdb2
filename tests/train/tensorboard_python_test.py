#!/usr/bin/env python3
"""--tensorboard as a user watches a run: train_resnet trains on 2 CPU ranks (rank 1
emulated 3x slower, so the planner moves samples to rank 0) with --tensorboard DIR and
--metrics, and TensorBoard's own reader (EventAccumulator, tensorboard==2.21.0) reads
DIR back. Every step's loss, step time and shares equal rank 0's metrics lines (to
float32), at the global step (1, 2, ... in order); the learning rate follows the
cosine schedule; the epochs' training loss and test accuracy equal the epoch lines;
the split is text at the first step and at every step that changed it.

Whether and when the planner changes the split here depends on measured times (the
emulated slowdown stretches what each rank measures, and a loaded machine measures
otherwise), so this test requires no change: it checks that the texts are exactly the
first split and the changes the metrics report, whichever they are. That a change is
made at a known step and written as text is checked with injected timings, on any
machine, by TrainerTensorBoard.APlanChangeFromInjectedTimingsIsTextAtTheStepOfTheChange
(tests/train/tensorboard_plan_test.cpp)."""
import argparse
import glob
import json
import math
import os
import subprocess
import sys
import tempfile

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util

failures = 0

EPOCHS = 2
STEPS_PER_EPOCH = 6  # 192 samples in global batches of 32
LR = 0.05


def check(ok, what):
    global failures
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    failures += not ok


def close(a, b, rel=1e-6, abs_=1e-6):
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-resnet", required=True)
    ap.add_argument("--hddp-run", required=True)
    args = ap.parse_args()
    d = tempfile.mkdtemp()
    tb_dir, metrics = f"{d}/tb", f"{d}/metrics.jsonl"
    cmd = [args.hddp_run, "--nproc-per-node", "2", "--", args.train_resnet, "--model", "resnet20",
           "--dataset", "synthetic", "--image-size", "16", "--limit-train", "192", "--limit-test",
           "64", "--global-batch", "32", "--epochs", str(EPOCHS), "--lr", str(LR), "--workers",
           "0", "--threads", "1", "--progress", "lines", "--emulate-slowdown", "1:3", "--metrics",
           metrics, "--tensorboard", tb_dir]
    env = dict(os.environ, HDDP_DEVICE="cpu")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=env)
    if r.returncode != 0:
        print("train_resnet failed:", " ".join(cmd), "\n", r.stdout[-2000:], r.stderr[-4000:])
        sys.exit(1)
    records = [json.loads(line) for line in open(metrics) if line.strip()]
    steps = [x for x in records if x["kind"] == "step"]
    epochs = [x for x in records if x["kind"] == "epoch"]
    check([x["step"] for x in steps] == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1)),
          f"the metrics file has steps 1..{EPOCHS * STEPS_PER_EPOCH}")

    files = glob.glob(f"{tb_dir}/events.out.tfevents.*")
    check(len(files) == 1, f"one event file in the folder: {files}")
    acc = event_accumulator.EventAccumulator(
        tb_dir, size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    print("scalars:", sorted(tags["scalars"]), "\ntensors:", sorted(tags["tensors"]))
    for tag in ("train/loss", "train/samples_per_s", "train/lr", "share/rank0", "share/rank1",
                "time/step_s", "time/data_wait_s", "time/compute_s", "time/comm_wait_s",
                "memory/rank0_resident_bytes", "epoch/train_loss",
                "epoch/samples_per_s", "eval/test_acc", "eval/test_loss"):
        check(tag in tags["scalars"], f"scalar {tag}")
    check("plan" in tags["tensors"], "text plan")
    if failures:
        sys.exit(1)

    def series(tag):
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    loss = series("train/loss")
    check([s for s, _ in loss] == [x["step"] for x in steps], "train/loss at the global steps, in order")
    check(all(close(v, x["loss"]) for (_, v), x in zip(loss, steps)),
          "train/loss equals the metrics lines' loss: "
          f"{[round(v, 5) for _, v in loss[:4]]} vs {[round(x['loss'], 5) for x in steps[:4]]}")
    step_s = series("time/step_s")
    check(len(step_s) == len(steps) and all(close(v, x["step_s"]) for (_, v), x in zip(step_s, steps)),
          "time/step_s equals the metrics lines' step_s")
    for rank in (0, 1):
        share = series(f"share/rank{rank}")
        want = [x["plan"][rank] / x["global_batch"] for x in steps]
        check([s for s, _ in share] == [x["step"] for x in steps] and
              all(close(v, w) for (_, v), w in zip(share, want)),
              f"share/rank{rank} is the plan's share: {[round(v, 3) for _, v in share]}")
    total = EPOCHS * STEPS_PER_EPOCH
    lr = series("train/lr")
    want_lr = [LR * 0.5 * (1 + math.cos(math.pi * (s - 1) / total)) for s, _ in lr]
    check(len(lr) == total and all(close(v, w) for (_, v), w in zip(lr, want_lr)),
          f"train/lr follows the cosine schedule at the global step: {[round(v, 5) for _, v in lr[:3]]}")

    ep_loss = series("epoch/train_loss")
    check([s for s, _ in ep_loss] == [STEPS_PER_EPOCH * (i + 1) for i in range(EPOCHS)] and
          all(close(v, x["train_loss"]) for (_, v), x in zip(ep_loss, epochs)),
          f"epoch/train_loss at each epoch's last step equals the epoch lines: {ep_loss}")
    test_acc = series("eval/test_acc")
    check(len(test_acc) == EPOCHS and all(close(v, x["test_acc"]) for (_, v), x in zip(test_acc, epochs)),
          f"eval/test_acc equals the epoch lines: {test_acc}")

    texts = [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode())
             for e in acc.Tensors("plan")]
    print("plan texts:", texts)
    first = steps[0]
    want_texts = [(1, f"step 1: [{first['plan'][0]}, {first['plan'][1]}] of 32")]
    for x in steps:
        if "new_plan" in x:
            new, old = x["new_plan"], x["plan"]
            want_texts.append((x["step"], f"from step {x['step'] + 1}: [{new[0]}, {new[1]}] of 32 "
                                          f"(was [{old[0]}, {old[1]}] of 32)"))
    # Not required (see the top): the change itself is checked with injected timings.
    print(f"the planner changed the split {len(want_texts) - 1} time(s) in {len(steps)} steps")
    check(texts == want_texts, f"the split as text at the start and at each change: {want_texts}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
