#!/usr/bin/env python3
"""ZeRO memory benchmark: the largest model two unlike cards train, by sharding.

Two ranks on hddp's emulated accelerator (emu), whose allocator counts every
allocation against a total and fails beyond it: a small and a large card (--totals
8:24 units of --unit-mib). An MLP of growing width with Adam (float32): for each of
plain DDP, ZeRO-1 and ZeRO-2 with equal and with memory-weighted shards, the largest
width that trains (a bisection on the width; a rank out of memory ends the job).

Printed against what the byte count allows for each stage (float32 Adam: 4 bytes of
parameters, 4 of gradients, 8 of state per parameter; activations on top; n ranks of
totals M_r):
  plain DDP        16 P <= min M_r
  ZeRO-1           8 P + 8 P s_r <= M_r   (s_r the rank's share of the state)
  ZeRO-2           4 P + 12 P s_r <= M_r
equal shards: s_r = 1/n; the best shares solve all ranks at once. Then the samples/s
of every mode at a width all of them train, against plain DDP in the same run.

  python3 bench/zero_memory.py --build build
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = [
    ("plain DDP", 0, "equal"),
    ("ZeRO-1 equal", 1, "equal"),
    ("ZeRO-1 memory", 1, "memory"),
    ("ZeRO-2 equal", 2, "equal"),
    ("ZeRO-2 memory", 2, "memory"),
]


def params_of(width, layers, inputs=64, classes=10):
    return inputs * width + width + layers * (width * width + width) + width * classes + classes


def run(args, zero, shard_by, width, steps, batch=None, bucket_mib=None):
    cmd = [
        os.path.join(args.build, "tools", "hddp-run", "hddp-run"), "--nproc-per-node", "2", "--",
        os.path.join(args.build, "bench", "zero_memory_bench"), "--zero", str(zero), "--shard-by",
        shard_by, "--width", str(width), "--layers", str(args.layers), "--steps", str(steps),
        "--totals", args.totals, "--unit-mib", str(args.unit_mib), "--bucket-mib",
        str(bucket_mib or args.bucket_mib), "--global-batch", str(batch or args.global_batch)
    ]
    env = dict(os.environ, HDDP_LOG_LEVEL="warn", HDDP_EMU_DEVICES="2")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    results = []
    for line in p.stdout.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except ValueError:
            continue
        if record.get("kind") == "result":
            results.append(record)
    ok = p.returncode == 0 and len(results) == 2 and all(r["ok"] for r in results)
    if p.returncode == 0 and not ok:
        sys.exit("zero_memory_bench ended 0 without two results:\n" + p.stdout + p.stderr)
    return ok, sorted(results, key=lambda r: r["rank"])


def largest_width(args, zero, shard_by):
    """Bisection over widths (multiples of --step): the largest that trains."""
    lo, hi = 0, None
    w = args.start_width
    while hi is None:  # grow until a width fails
        ok, _ = run(args, zero, shard_by, w, args.steps)
        if ok:
            lo = w
            w *= 2
        else:
            hi = w
        if w > 1 << 14:
            sys.exit("no width failed up to 16384: raise --layers or lower --totals")
    while hi - lo > args.step:
        mid = (lo + hi) // 2 // args.step * args.step
        if mid <= lo:
            break
        ok, _ = run(args, zero, shard_by, mid, args.steps)
        if ok:
            lo = mid
        else:
            hi = mid
    return lo


def byte_bound(stage, totals, equal):
    """The most parameters (in bytes of float32 parameters x 1/4, i.e. P) the byte
    count allows for `stage`, ignoring activations."""
    n = len(totals)
    if stage == 0:
        return min(totals) / 16.0
    fixed, sharded = (8.0, 8.0) if stage == 1 else (4.0, 12.0)
    if equal:
        return min(m / (fixed + sharded / n) for m in totals)
    # Best shares: P fits when every rank holds the unsharded part (fixed P <= M_r)
    # and the ranks' room for the sharded part adds up to all of it:
    # sum_r (M_r - fixed P) / (sharded P) >= 1. Bisect on P.
    lo, hi = 0.0, min(totals) / fixed
    for _ in range(200):
        p = (lo + hi) / 2
        if sum((m - fixed * p) / (sharded * p) for m in totals) >= 1.0:
            lo = p
        else:
            hi = p
    return lo


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--totals", default="8:24", help="device totals per rank, in units")
    ap.add_argument("--unit-mib", type=float, default=4.0)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--bucket-mib", type=float, default=0.0625)
    ap.add_argument("--start-width", type=int, default=64)
    ap.add_argument("--step", type=int, default=8, help="width resolution")
    ap.add_argument("--timing-steps", type=int, default=60)
    ap.add_argument("--timing-batch", type=int, default=64,
                    help="global batch of the timing runs (memory is not the question there)")
    ap.add_argument("--timing-bucket-mib", type=float, default=25.0,
                    help="DDP bucket and gather chunk of the timing runs (DDP's default)")
    ap.add_argument("--timing-width", type=int, default=0,
                    help="time at this width only, without the memory search")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds, in turns (median)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    unit = args.unit_mib * 1024 * 1024
    totals = [float(t) * unit for t in args.totals.split(":")]
    t0 = time.time()
    rows = []
    by_mode = {}
    if not args.timing_width:
        for name, zero, by in MODES:
            width = largest_width(args, zero, by)
            params = params_of(width, args.layers)
            bound = byte_bound(zero, totals, equal=(by == "equal" or zero == 0))
            rows.append({"mode": name, "zero": zero, "shard_by": by, "width": width, "params": params,
                         "byte_bound_params": bound, "of_bound": params / bound})
            print(f"{name:15s} largest width {width:5d}: {params / 1e6:6.3f} M parameters, "
                  f"{params / bound:5.2f} of the byte count's {bound / 1e6:6.3f} M", flush=True)
        by_mode = {r["mode"]: r for r in rows}
        print()
        for stage in (1, 2):
            weighted = by_mode[f"ZeRO-{stage} memory"]["params"]
            equal = by_mode[f"ZeRO-{stage} equal"]["params"]
            print(f"ZeRO-{stage}: memory-weighted / equal shards = {weighted / equal:.2f}x; "
                  f"/ plain DDP = {weighted / by_mode['plain DDP']['params']:.2f}x")
    # Throughput where every mode fits: plain DDP's largest width, halved.
    width = args.timing_width or max(args.step,
                                     by_mode["plain DDP"]["width"] // 2 // args.step * args.step)
    print(f"\nsamples/s at width {width} ({params_of(width, args.layers) / 1e6:.3f} M parameters), "
          f"{args.timing_steps} steps of {args.timing_batch} samples, buckets of "
          f"{args.timing_bucket_mib} MiB, median of {args.rounds} rounds in turns, against plain DDP:")
    # Rounds in turns, each mode's median: the modes share the machine's noise.
    runs = {name: [] for name, _, _ in MODES}
    for _ in range(args.rounds):
        for name, zero, by in MODES:
            ok, results = run(args, zero, by, width, args.timing_steps, args.timing_batch,
                              args.timing_bucket_mib)
            if not ok:
                sys.exit(f"{name} failed at width {width}, which plain DDP trains")
            runs[name].append(results)
    speeds = {}
    for name, _, _ in MODES:
        speeds[name] = statistics.median(r[0]["samples_per_s"] for r in runs[name])
    for name, _, _ in MODES:
        results = runs[name][0]
        peaks = [r["peak_bytes"] / unit for r in results]
        states = [r["state_bytes"] / unit for r in results]
        rounds = ", ".join(f"{r[0]['samples_per_s']:.0f}" for r in runs[name])
        print(f"  {name:15s} {speeds[name]:8.1f} samples/s = {speeds[name] / speeds['plain DDP']:.3f}x"
              f" ({rounds})   peak {peaks[0]:.2f} / {peaks[1]:.2f} units, state "
              f"{states[0]:.2f} / {states[1]:.2f}", flush=True)
        rows.append({"mode": name, "timing_width": width, "samples_per_s": speeds[name],
                     "vs_plain": speeds[name] / speeds["plain DDP"], "peak_units": peaks,
                     "state_units": states})
    print(f"\n({time.time() - t0:.0f} s; totals {args.totals} x {args.unit_mib} MiB, "
          f"{args.layers} hidden layers, global batch {args.global_batch})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
