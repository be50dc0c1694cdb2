#!/usr/bin/env python3
"""Allreduce bus bandwidth, hddp vs PyTorch's torch.distributed Gloo, in one run.

Both run under hddp-run with the same world size and message sizes, alternating for
--rounds rounds (the best of each is kept, to damp a shared machine's noise). Prints a
table with the ratio hddp / torch per size.

  bench/allreduce_compare.py --build build --nproc 2
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
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--min-bytes", type=int, default=4096)
    p.add_argument("--max-bytes", type=int, default=16 << 20)
    p.add_argument("--seconds", type=float, default=0.3)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args()

    launcher = os.path.join(a.build, "tools", "hddp-run", "hddp-run")
    bench = os.path.join(a.build, "bench", "allreduce_bench")
    sizes = ["--min-bytes", str(a.min_bytes), "--max-bytes", str(a.max_bytes), "--seconds", str(a.seconds)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HDDP_LOG_LEVEL="warn")
    best = {}
    for _ in range(a.rounds):
        for impl, cmd in (("hddp", [bench] + sizes),
                          ("torch", [a.python, os.path.join(here, "allreduce_torch.py")] + sizes)):
            for row in run_json([launcher, "--nproc-per-node", str(a.nproc), "--no-prefix", "--"] + cmd, env):
                key = (impl, row["bytes"])
                if key not in best or row["bus_GBps"] > best[key]["bus_GBps"]:
                    best[key] = row
    print(f"allreduce bus bandwidth, {a.nproc} CPU ranks on loopback, float32, best of {a.rounds} rounds")
    print(f"{'bytes':>10} {'hddp GB/s':>10} {'torch GB/s':>11} {'hddp/torch':>11}")
    rows = []
    for nbytes in sorted({k[1] for k in best}):
        h, t = best[("hddp", nbytes)], best[("torch", nbytes)]
        ratio = h["bus_GBps"] / t["bus_GBps"]
        rows.append({"bytes": nbytes, "hddp_GBps": h["bus_GBps"], "torch_GBps": t["bus_GBps"], "ratio": ratio})
        print(f"{nbytes:>10} {h['bus_GBps']:>10.3f} {t['bus_GBps']:>11.3f} {ratio:>11.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
