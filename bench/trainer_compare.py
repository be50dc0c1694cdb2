#!/usr/bin/env python3
"""Unlike ranks through the shipped trainer: equal split (PyTorch DDP's) vs hddp's planner.

Runs examples' train_resnet under hddp-run on CPU ranks, as a user would, once with
--no-balance (the equal split) and once with the planner, back to back, and reads the
ranks' metrics files. Two scenarios:

  speed  3 ranks at speeds 1 : 1/2 : 1/4 (--emulate-slowdown 1:2,2:4), synthetic
         28x28 images, ResNet-20. The arithmetic limit of planner over equal is
         (1 + 1/2 + 1/4) / (3 x 1/4) = 2.33x.
  link   2 ranks of equal compute, rank 1's input link emulated (--emulate-link-gbps),
         224x224 RGB inputs: planner vs equal vs the model's prediction (a split from
         each rank's measured compute per sample plus input bytes over its link).

For each run: global samples/s over the steps after --skip, the final split, and the
ranks' own speed while they train together (samples over their compute seconds, the
emulated stretch included: "capacity"). Delivered = global samples/s / capacity says
what the split and the synchronisation lose; capacity / the nominal speeds says what
the shared cores lose (3 processes on 2 cores slow each other).

  bench/trainer_compare.py --build build --scenario speed [--steps 100]
  bench/trainer_compare.py --build build --scenario link [--gbps 2.8]
  bench/trainer_compare.py --build build --scenario speed --sync-bn   (SyncBatchNorm: the
         fast ranks block in its collectives inside forward; the planner must still see
         each rank's own speed)
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def read_steps(path):
    rows = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "step":
                rows.append(r)
    return rows


def run(a, world, mode, extra, tmp):
    launcher = os.path.join(a.build, "tools", "hddp-run", "hddp-run")
    trainer = os.path.join(a.build, "examples", "resnet", "train_resnet")
    metrics = os.path.join(tmp, f"{mode}.jsonl")
    cmd = [launcher, "--nproc-per-node", str(world), "--", trainer, "--dataset", "synthetic",
           "--max-steps", str(a.steps), "--global-batch", str(a.global_batch), "--threads", "1",
           "--workers", "1", "--limit-test", "64", "--no-augment", "--progress", "off",
           "--metrics", metrics] + extra + (["--no-balance"] if mode == "equal" else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", HDDP_LOG_LEVEL="warn")
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    ranks = [read_steps(metrics)]
    for r in range(1, world):
        ranks.append(read_steps(os.path.join(tmp, f"{mode}.rank{r}.jsonl")))
    timed = [[s for s in steps if s["step"] > a.skip] for steps in ranks]
    seconds = sum(s["step_s"] for s in timed[0])
    samples = sum(s["global_batch"] for s in timed[0])
    # A rank's own speed: its samples over its compute (emulated stretch and link
    # included), the steps without samples left out.
    own = []
    for steps in timed:
        busy = [s for s in steps if s["local_batch"] > 0]
        own.append(sum(s["local_batch"] for s in busy) /
                   sum(s["compute_s"] for s in busy))
    return {"mode": mode, "samples_per_s": samples / seconds, "final_split": ranks[0][-1]["plan"],
            "own_samples_per_s": own, "capacity": sum(own),
            "compute_s_per_sample": [1.0 / x for x in own]}


def split_for(rates, batch):
    """The largest-remainder split of `batch` in proportion to `rates`."""
    total = sum(rates)
    exact = [batch * r / total for r in rates]
    out = [int(x) for x in exact]
    for i in sorted(range(len(rates)), key=lambda i: exact[i] - out[i], reverse=True)[:batch - sum(out)]:
        out[i] += 1
    return out


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.path.join(here, "..", "build"))
    p.add_argument("--scenario", choices=["speed", "link"], default="speed")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--skip", type=int, default=20, help="steps left out of the figures (calibration)")
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--gbps", type=float, default=2.8, help="link: rank 1's emulated input link, GB/s")
    p.add_argument("--image-size", type=int, default=224, help="link: input side in pixels")
    p.add_argument("--model", default=None, help="train_resnet --model (default: resnet20 for speed, resnet18 for link)")
    p.add_argument("--sync-bn", action="store_true", help="train_resnet --sync-bn (SyncBatchNorm's collectives in forward)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if a.scenario == "speed":
            world, speeds = 3, [1.0, 0.5, 0.25]
            extra = ["--emulate-slowdown", "1:2,2:4"]
        else:
            world, speeds = 2, [1.0, 1.0]
            extra = ["--emulate-link-gbps", f"1:{a.gbps:g}", "--image-size", str(a.image_size),
                     "--channels", "3"]
        extra += ["--model", a.model or ("resnet20" if a.scenario == "speed" else "resnet18")]
        extra += ["--sync-bn"] if a.sync_bn else []
        equal = run(a, world, "equal", extra, tmp)
        planner = run(a, world, "planner", extra, tmp)
    B = a.global_batch
    ratio = planner["samples_per_s"] / equal["samples_per_s"]
    out = {"scenario": a.scenario, "sync_bn": a.sync_bn, "steps": a.steps, "skip": a.skip, "global_batch": B,
           "equal": equal, "planner": planner, "planner_over_equal": ratio}
    print(f"train_resnet, {world} CPU ranks, 1 thread each, synthetic data, global batch {B}, "
          f"{a.steps} steps (figures over steps > {a.skip}){', SyncBatchNorm' if a.sync_bn else ''}")
    for r in (equal, planner):
        print(f"  {r['mode']:8s} {r['samples_per_s']:7.1f} samples/s, final split {r['final_split']}, "
              f"ranks' own speed {['%.1f' % x for x in r['own_samples_per_s']]} samples/s "
              f"(capacity {r['capacity']:.1f}), delivered {r['samples_per_s'] / r['capacity']:.3f} of capacity")
    if a.scenario == "speed":
        limit = sum(speeds) / (world * min(speeds))
        # The limit with the speeds the ranks really had in the planner run: the best
        # split of those speeds over the equal split of the same speeds.
        own = planner["own_samples_per_s"]
        real_limit = sum(own) / (world * min(own))
        print(f"  planner / equal: {ratio:.2f}x; nominal limit {limit:.2f}x -> {ratio / limit:.3f} of it; "
              f"limit from the ranks' own speeds in the run {real_limit:.2f}x -> {ratio / real_limit:.3f} of it")
        print(f"  split: nominal best {split_for(speeds, B)}, best for the own speeds {split_for(own, B)}, "
              f"planner's {planner['final_split']}")
        out.update(nominal_limit=limit, of_nominal_limit=ratio / limit, own_limit=real_limit,
                   of_own_limit=ratio / real_limit)
    else:
        # The model's prediction: the equal run's own compute per sample of each rank
        # (rank 1's includes its emulated link, as its cost does: CPU ranks copy
        # nothing, so the transfer adds to compute), split in proportion to speed.
        per = equal["compute_s_per_sample"]
        predicted = split_for([1.0 / x for x in per], B)
        predicted_ratio = max(per[r] * B / world for r in range(world)) / max(
            per[r] * predicted[r] for r in range(world))
        bytes_per_sample = 3 * a.image_size * a.image_size * 4
        print(f"  link: {a.gbps:g} GB/s, {bytes_per_sample / 1e3:.0f} kB/sample -> "
              f"{bytes_per_sample / (a.gbps * 1e9) * 1e3:.3f} ms/sample of transfer; compute "
              f"{['%.2f ms' % (x * 1e3) for x in per]} per sample (rank 1's with the transfer)")
        print(f"  model: split {predicted}, planner / equal {predicted_ratio:.3f}x; measured: split "
              f"{planner['final_split']}, planner / equal {ratio:.3f}x")
        out.update(predicted_split=predicted, predicted_ratio=predicted_ratio)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
