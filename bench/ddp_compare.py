#!/usr/bin/env python3
"""Homogeneous DDP training throughput: hddp vs PyTorch's DistributedDataParallel.

ResNet-18 (CIFAR stem, 32x32 synthetic images), batch 64 per rank, 1 thread per rank,
all measured in one run on this machine:
  - hddp DDP and PyTorch DDP (Python, gloo), 2 ranks under hddp-run: global images/s;
  - the ideal: 2 plain LibTorch loops (no communication) running at the same time,
    the sum of their images/s; each DDP's fraction of it;
  - share of hddp's allreduce time hidden behind backward (per step, mean of ranks);
  - single-rank overhead: hddp DDP at world size 1 vs the plain loop.

  bench/ddp_compare.py --build build [--steps 8 --rounds 1]
"""
import argparse
import json
import os
import sys

from launch_json import run_json


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.path.join(here, "..", "build"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--json", help="also write the results to this file")
    a = p.parse_args()
    launcher = os.path.join(a.build, "tools", "hddp-run", "hddp-run")
    cpp = [os.path.join(a.build, "bench", "ddp_resnet_bench")]
    py = [a.python, os.path.join(here, "ddp_resnet_torch.py")]
    common = ["--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HDDP_LOG_LEVEL="warn")

    def job(nproc, prog, mode):
        rows = run_json([launcher, "--nproc-per-node", str(nproc), "--no-prefix", "--"] + prog + ["--mode", mode] + common, env)
        assert len(rows) == nproc, rows
        return rows

    def global_rate(rows):
        return sum(r["batch"] for r in rows) * rows[0]["steps"] / max(r["seconds"] for r in rows)

    best = {}
    for _ in range(a.rounds):
        results = {
            "hddp_ddp2": job(2, cpp, "ddp"),
            "torch_ddp2": job(2, py, "ddp"),
            "plain2": job(2, cpp, "plain"),
            "hddp_ddp1": job(1, cpp, "ddp"),
            "plain1": job(1, cpp, "plain"),
        }
        for k, rows in results.items():
            rate = global_rate(rows) if "ddp" in k else sum(r["images_per_s"] for r in rows)
            if k not in best or rate > best[k][0]:
                best[k] = (rate, rows)
    hddp, torch_ddp, ideal = best["hddp_ddp2"][0], best["torch_ddp2"][0], best["plain2"][0]
    hidden = sum(r["hidden_fraction"] for r in best["hddp_ddp2"][1]) / 2
    single = best["hddp_ddp1"][0] / best["plain1"][0]
    print(f"ResNet-18 (CIFAR stem, 32x32), batch {a.batch}/rank, 1 thread/rank, {a.steps} timed steps, best of {a.rounds}")
    print(f"  2-rank images/s      hddp {hddp:8.2f}   PyTorch DDP {torch_ddp:8.2f}   ratio hddp/PyTorch {hddp / torch_ddp:5.3f}")
    print(f"  ideal (2 plain loops at once) {ideal:8.2f} images/s: hddp {hddp / ideal:5.3f}, PyTorch DDP {torch_ddp / ideal:5.3f} of ideal")
    print(f"  hddp allreduce time hidden behind backward: {hidden:5.3f} (mean of ranks and steps)")
    print(f"  single rank: hddp DDP {best['hddp_ddp1'][0]:8.2f} vs plain loop {best['plain1'][0]:8.2f} images/s: ratio {single:5.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({k: v[1] for k, v in best.items()}, f, indent=1)


if __name__ == "__main__":
    main()
