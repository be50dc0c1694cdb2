#!/usr/bin/env python3
"""Gradient compression over a slow link: none, fp16, PowerSGD rank 1 and 4, auto (#35).

Runs the shipped ResNet trainer (train_resnet) on 2 CPU ranks on Fashion-MNIST with an
emulated link under every collective (--emulate-link-gbps on both ranks: the ring over
it is what the gradients cross), once per compression, the same steps each, and prints
for each: global samples/s, the training time (the epochs' own seconds, evaluations
left out) until the test accuracy first reaches the target, and the final accuracy.
An "epoch" here is --limit-train samples, so the test set is evaluated every
limit-train / global-batch steps. With --slow, rank 1 also computes 3x slower
(--emulate-slowdown 1:3, the planner on as always). For `auto` the table names what the
trainer chose (the metrics' config record) and the check says whether that is the
fastest of the fixed choices measured in the same run.

usage: python3 bench/compress_compare.py [--build build] [--link-gbps 0.005]
       [--steps 600] [--slow] [--out DIR]
"""

import argparse
import json
import os
import subprocess
import sys
import time

CONFIGS = ["none", "fp16", "powersgd:1", "powersgd:4", "auto"]


def run(args, compress, out_dir):
    metrics = os.path.join(out_dir, f"m-{compress.replace(':', '')}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    epochs = max(1, args.steps * args.global_batch // args.limit_train)
    link = f"0:{args.link_gbps},1:{args.link_gbps}"
    cmd = [
        os.path.join(args.build, "tools/hddp-run/hddp-run"), "--nproc-per-node", "2", "--",
        os.path.join(args.build, "examples/resnet/train_resnet"),
        "--model", "resnet9", "--dataset", "fashion-mnist", "--data", args.data,
        "--amp", "auto", "--global-batch", str(args.global_batch), "--lr", "0.1",
        "--warmup-epochs", "0.3", "--no-augment", "--workers", "1",
        "--limit-train", str(args.limit_train), "--epochs", str(epochs), "--eval-every", "1",
        "--progress", "off", "--metrics", metrics, "--compress", compress,
        "--emulate-link-gbps", link,
    ]
    if args.slow:
        cmd += ["--emulate-slowdown", "1:3"]
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)}\nfailed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in open(metrics)]
    epochs_seen = [r for r in records if r.get("kind") == "epoch"]
    steps = [r for r in records if r.get("kind") == "step"]
    summary = [r for r in records if r.get("kind") == "summary"]
    config = next((r for r in records if r.get("kind") == "config"), {})
    trained = 0.0
    reached = None
    for e in epochs_seen:
        trained += e["seconds"]
        if reached is None and e.get("test_acc", 0) >= args.target:
            reached = trained
    waits = sorted(s["comm_wait_s"] for s in steps if s["step"] >= 4)
    predicted = next((s["allreduce_predicted_s"] for s in steps if "allreduce_predicted_s" in s), 0)
    return {
        "compress": compress,
        "chosen": config.get("compression", compress),
        "samples_per_s": summary[-1]["samples_per_s"] if summary and "samples_per_s" in summary[-1]
        else sum(e["samples_per_s"] * e["seconds"] for e in epochs_seen) / max(trained, 1e-9),
        "train_seconds": trained,
        "seconds_to_target": reached,
        "final_acc": epochs_seen[-1].get("test_acc") if epochs_seen else None,
        "median_comm_wait_s": waits[len(waits) // 2] if waits else None,
        "allreduce_predicted_s": predicted,
        "wall_seconds": wall,
        "command": " ".join(cmd),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default="build")
    p.add_argument("--data", default=os.environ.get("HDDP_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))
    p.add_argument("--link-gbps", type=float, default=0.005)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--limit-train", type=int, default=12800)
    p.add_argument("--target", type=float, default=0.90)
    p.add_argument("--slow", action="store_true", help="rank 1 computes 3x slower")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default="/tmp/hddp-compress")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = []
    for c in args.configs.split(","):
        r = run(args, c, args.out)
        results.append(r)
        print(json.dumps(r), flush=True)
    plain = next((r for r in results if r["compress"] == "none"), None)
    print(f"\n{args.steps} steps of ResNet-9, 2 CPU ranks{' (rank 1 3x slower)' if args.slow else ''}, "
          f"link {args.link_gbps} GB/s under the collectives, target test accuracy {args.target}\n")
    print("| compression | samples/s | median comm_wait_s | training s to "
          f"{args.target} | vs none | final test acc |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        t = r["seconds_to_target"]
        speedup = (plain["seconds_to_target"] / t) if (plain and plain["seconds_to_target"] and t) else None
        name = r["compress"] if r["compress"] != "auto" else f"auto (chose {r['chosen']})"
        print(f"| {name} | {r['samples_per_s']:.0f} | {r['median_comm_wait_s']:.3f} | "
              f"{'%.0f' % t if t else 'not reached'} | {'%.2fx' % speedup if speedup else '-'} | "
              f"{r['final_acc']:.4f} |")
    auto = next((r for r in results if r["compress"] == "auto"), None)
    fixed = [r for r in results if r["compress"] != "auto"]
    if auto and fixed:
        fastest = max(fixed, key=lambda r: r["samples_per_s"])
        same = next((r for r in fixed if r["compress"] == auto["chosen"]), None)
        print(f"\nauto chose {auto['chosen']}; the fastest fixed choice measured: "
              f"{fastest['compress']} ({fastest['samples_per_s']:.0f} samples/s)"
              + (f"; {auto['chosen']} measured {same['samples_per_s']:.0f} samples/s, "
                 f"{same['samples_per_s'] / fastest['samples_per_s']:.2f}x the fastest" if same else ""))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
