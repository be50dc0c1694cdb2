#!/usr/bin/env python3
"""Activation checkpointing: peak memory and time per step, with vs without, per model.

Each configuration runs in its own process (checkpoint_bench). CPU: peak resident
memory above the level before the timed steps; CUDA (--device cuda): peak allocated
bytes. Prints memory and time ratios (checkpointed / plain).

  bench/checkpoint_compare.py --build build [--device cpu] [--models resnet18 unet]
"""
import argparse
import json
import os
import subprocess


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.path.join(here, "..", "build"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--models", nargs="+", default=["resnet18", "unet"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args()
    exe = os.path.join(a.build, "bench", "checkpoint_bench")
    # glibc: allocations above 128 KiB always mmap'd, so freed activations leave the
    # resident set and peak RSS tracks live memory (else the dynamic threshold keeps
    # some resident and the figure depends on allocation history).
    env = dict(os.environ, HDDP_LOG_LEVEL="warn", MALLOC_MMAP_THRESHOLD_="131072")
    rows = []
    print(f"activation checkpointing on {a.device}, batch {a.batch}, {a.steps} timed steps")
    print(f"{'model':>10} {'plain MiB':>10} {'ckpt MiB':>9} {'memory':>7} {'plain s':>8} {'ckpt s':>7} {'time':>6}")
    for model in a.models:
        r = {}
        for ck in (0, 1):
            out = subprocess.run([exe, "--model", model, "--checkpoint", str(ck), "--batch", str(a.batch),
                                  "--steps", str(a.steps), "--threads", str(a.threads), "--device", a.device],
                                 check=True, capture_output=True, text=True, env=env)
            r[ck] = json.loads([l for l in out.stdout.splitlines() if l.startswith("{")][-1])
        mem = r[1]["peak_bytes_above_baseline"] / r[0]["peak_bytes_above_baseline"]
        t = r[1]["seconds_per_step"] / r[0]["seconds_per_step"]
        rows.append({"model": model, "plain": r[0], "checkpoint": r[1], "memory_ratio": mem, "time_ratio": t})
        print(f"{model:>10} {r[0]['peak_bytes_above_baseline'] / 2**20:>10.1f} {r[1]['peak_bytes_above_baseline'] / 2**20:>9.1f} "
              f"{mem:>7.3f} {r[0]['seconds_per_step']:>8.3f} {r[1]['seconds_per_step']:>7.3f} {t:>6.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
