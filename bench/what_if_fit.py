#!/usr/bin/env python3
"""Fits what-if's uncalibrated model to the device table's published training figures.

The model (include/hddp/balance/what_if.h): a card D trains one sample in
    training FLOPs / (peak(D) x efficiency) + traffic x activation bytes / bandwidth(D)
with the FLOPs and the activation bytes counted from the model by hddp-probe
(--save-profile), peak and memory bandwidth from data/devices.json. This script profiles
each (model, input, precision) of the table's "published" list, then searches the
efficiency and the traffic factor that make the largest relative error over all figures
smallest (a grid, minimax), and prints both with each figure's error. The defaults in
what_if.h (kFittedEfficiency, kFittedMemoryTraffic, kFittedUncertainty) come from this
output; the test WhatIf.UncalibratedPredictionsMatchPublishedFigures holds them to it.

  bench/what_if_fit.py --build build [--table data/devices.json]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def profile(probe, model, shape, amp, folder):
    path = os.path.join(folder, f"{model}-{shape}-{amp}.json")
    if not os.path.exists(path):
        subprocess.run([probe, "--what-if", "a100", "--model", model, "--input", shape,
                        "--amp", amp, "--classes", "1000", "--save-profile", path,
                        "--global-batch", "8"],
                       check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--table", default=os.path.join(os.path.dirname(__file__), "..", "data",
                                                    "devices.json"))
    a = ap.parse_args()
    probe = os.path.join(a.build, "tools", "hddp-probe", "hddp-probe")
    table = json.load(open(a.table))
    figures = table["published"]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for f in figures:
            p = profile(probe, f["model"], f["input"], f["amp"], folder)
            d = table["devices"][f["device"]]
            rate = {"off": 0, "fp16": d["fp16_tflops"], "bf16": d["bf16_tflops"]}[f["amp"]]
            peak = (rate or d["fp32_tflops"]) * 1e12
            rows.append((f, p["train_flops_per_sample"], p["activation_bytes_per_sample"], peak,
                         d["memory_GBps"] * 1e9))

    def errors(e, k):
        return [1.0 / (fl / (peak * e) + k * act / bw) / f["samples_per_second"] - 1.0
                for f, fl, act, peak, bw in rows]

    best = None
    for ei in range(10, 101):
        for ki in range(0, 401):
            e, k = ei / 100.0, ki / 10.0
            worst = max(abs(x) for x in errors(e, k))
            if best is None or worst < best[0]:
                best = (worst, e, k)
    worst, e, k = best
    print(f"fit over {len(rows)} published figures: efficiency {e:.2f}, memory traffic "
          f"{k:.1f} bytes per activation byte, largest error {100 * worst:.1f}%")
    for (f, fl, act, peak, bw), err in zip(rows, errors(e, k)):
        print(f"  {f['device']:<10} {f['model']} {f['amp']:<4} published "
              f"{f['samples_per_second']:>6.0f}/s  predicted "
              f"{f['samples_per_second'] * (1 + err):>6.0f}/s  {100 * err:+.1f}%  "
              f"({fl / 1e9:.1f} GFLOPs, {act / 2**20:.1f} MiB activations per sample)")
    products = max(abs(x) for x in errors(e, 0.0))
    print(f"products only at the same efficiency: largest error {100 * products:.0f}%")


if __name__ == "__main__":
    sys.exit(main())
