#!/usr/bin/env python3
"""Differential matrix against PyTorch (issue #49, docs/reliability.md).

Draws seeded random configurations (world size 1-3 with a random split of every
micro-step, zero shares included; SGD with momentum/dampening/Nesterov/weight decay,
Adam, AdamW with or without amsgrad; ZeRO 0/1/2 with random shard weights; gradient
clipping; accumulation with noSync() micro-steps; a zoo of models: mlp, bn, syncbn, tied,
unused), trains each with hddp on N ranks (bench/diff_matrix, threads of one process) and
with PyTorch in one process on the whole batch (reference.py), and compares parameters,
buffers and optimizer state in float64.

  matrix.py --driver build/bench/diff_matrix --seed 1 --count 200   # random seeds
  matrix.py --driver build/bench/diff_matrix --ci                   # the fixed CI list
  matrix.py --driver build/bench/diff_matrix --seed 7 --count 1 --show --keep --out /tmp/c

One line per case (PASS / FAIL / XFAIL / XPASS, the configuration, the worst
differences), then a total. Exit code 1 when a case fails (a regression marked xfail
does not count).
"""
import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import cases  # noqa: E402
import reference  # noqa: E402
import zoo  # noqa: E402

# Per tensor: max |hddp - reference| <= RTOL x max(max |reference|, FLOOR). The floor
# keeps tensors whose reference is ~0 (a momentum of zero gradients) from asking for
# more than 1e-14 absolute.
RTOL = 1e-9
FLOOR = 1e-5

# Disagreements found by the matrix, kept as fixed configurations (seed + pinned keys).
# "xfail": the reason, while hddp is not fixed; the case then reports XFAIL (or XPASS
# once it passes) and does not fail the run. Remove "xfail" when hddp is fixed.
REGRESSIONS = [
]


def ci_list():
    """About 30 fixed configurations: every zoo model with every optimizer kind, ZeRO
    0/1/2, no accumulation and 2-3 micro-steps, world sizes 1-3; the rest drawn from
    each seed (split, options, clipping, buckets). Then the regressions."""
    variants = [("sgd", 0, 1), ("adam", 1, 2), ("adamw", 2, 1), ("sgd", 2, 3), ("adam", 0, 2),
                ("sgd", 1, 1)]
    entries = []
    for i, model in enumerate(zoo.KINDS):
        for j, (opt, stage, micro) in enumerate(variants):
            world = 1 + (i + j) % 3 if (i + j) % 4 else 3
            entries.append({"seed": 1000 + 10 * i + j, "fixed": {
                "model": model, "world": world, "micro": micro, "optimizer": {"kind": opt},
                "zero": {"stage": stage}}})
    return entries + REGRESSIONS


def run_driver(driver, folders, jobs):
    """Runs the driver over the case folders in `jobs` processes; returns their outputs."""
    chunks = [folders[i::jobs] for i in range(jobs) if folders[i::jobs]]
    env = dict(os.environ, HDDP_LOG_LEVEL=os.environ.get("HDDP_LOG_LEVEL", "error"))
    procs = [subprocess.Popen([driver] + c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) for c in chunks]
    return [p.communicate()[0] for p in procs]


def read_ranks(folder, world):
    out = os.path.join(folder, "out")
    error = os.path.join(out, "error.txt")
    if os.path.exists(error):
        with open(error) as f:
            return None, f.read().strip()
    ranks = []
    for r in range(world):
        path = os.path.join(out, f"rank{r}.safetensors")
        if not os.path.exists(path):
            return None, f"the driver wrote no {path}"
        ranks.append(load_file(path))
    return ranks, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--driver", default=os.path.join(HERE, "..", "..", "build", "bench", "diff_matrix"))
    ap.add_argument("--seed", type=int, default=1, help="first seed (default 1)")
    ap.add_argument("--count", type=int, default=20, help="number of seeds (default 20)")
    ap.add_argument("--ci", action="store_true", help="the fixed CI list (and regressions) instead")
    ap.add_argument("--out", help="folder for the case folders (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the case folders")
    ap.add_argument("--jobs", type=int, default=1, help="driver processes in parallel (default 1)")
    ap.add_argument("--show", action="store_true", help="print each configuration as JSON")
    ap.add_argument("--plant-lr", type=float, default=1.0,
                    help="scale the reference's learning rate: every case must then FAIL")
    ap.add_argument("--model", choices=zoo.KINDS, help="pin the model of every drawn case")
    ap.add_argument("--world", type=int, choices=(1, 2, 3), help="pin the world size")
    args = ap.parse_args()
    torch.set_num_threads(1)
    driver = os.path.abspath(args.driver)
    if not os.access(driver, os.X_OK):
        sys.exit(f"no driver at {driver}: build it (ninja -C build diff_matrix) or pass --driver")

    if args.ci:
        entries = ci_list()
    else:
        pinned = {k: v for k, v in (("model", args.model), ("world", args.world)) if v is not None}
        entries = [{"seed": s, "fixed": pinned} for s in range(args.seed, args.seed + args.count)]
    root = args.out or tempfile.mkdtemp(prefix="diff-matrix-")
    os.makedirs(root, exist_ok=True)
    started = time.time()
    jobs = []
    for i, e in enumerate(entries):
        cfg = cases.draw(e["seed"], **e.get("fixed", {}))
        folder = os.path.join(root, f"case{i:04d}-seed{e['seed']}")
        cases.write(cfg, folder)
        jobs.append((e, cfg, folder))
        if args.show:
            print(json.dumps(cfg))
    # The references are computed while the driver runs (two cores: one each).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        driving = pool.submit(run_driver, driver, [f for _, _, f in jobs], max(1, args.jobs))
        expected = [reference.train(cfg, load_file(os.path.join(f, "data.safetensors")), args.plant_lr)
                    for _, cfg, f in jobs]
        outputs = driving.result()

    counts = {"PASS": 0, "FAIL": 0, "XFAIL": 0, "XPASS": 0}
    worst_abs = worst_rel = 0.0
    for (e, cfg, folder), want in zip(jobs, expected):
        ranks, error = read_ranks(folder, cfg["world"])
        if error is None:
            a, rel, problems = reference.compare(want, ranks, cfg["zero"]["stage"], RTOL, FLOOR)
            worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, rel)
            detail = f"max abs {a:.2e} rel {rel:.2e}"
        else:
            problems, detail = [f"driver: {error}"], "driver error"
        ok = not problems
        verdict = ("XPASS" if ok else "XFAIL") if e.get("xfail") else ("PASS" if ok else "FAIL")
        counts[verdict] += 1
        print(f"{verdict:5} {cases.summary(cfg)} | {detail}"
              + (f" | xfail: {e['xfail']}" if e.get("xfail") else ""))
        for p in problems[:6]:
            print(f"      {p}")
        if len(problems) > 6:
            print(f"      ... {len(problems) - 6} more")
    canary_caught = True
    if args.ci and args.plant_lr == 1.0:
        # The comparison can fail: the first case against a reference whose learning
        # rate is 1e-6 off must disagree.
        e, cfg, folder = jobs[0]
        ranks, error = read_ranks(folder, cfg["world"])
        planted = reference.train(cfg, load_file(os.path.join(folder, "data.safetensors")), 1 + 1e-6)
        canary_caught = error is None and bool(reference.compare(planted, ranks, cfg["zero"]["stage"],
                                                                 RTOL, FLOOR)[2])
        print(f"self-check: a reference learning rate 1e-6 off is "
              f"{'caught' if canary_caught else 'NOT caught: the comparison cannot fail'}"
              f" (seed {e['seed']})")
    seconds = time.time() - started
    coverage = {}
    for _, cfg, _ in jobs:
        for tag in cases.axes(cfg):
            coverage[tag] = coverage.get(tag, 0) + 1
    print("coverage (cases per feature): " + ", ".join(f"{k} {v}" for k, v in sorted(coverage.items())))
    print(f"total {len(jobs)}: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v)
          + f"; worst abs {worst_abs:.2e}, rel {worst_rel:.2e} (tolerance rel {RTOL:g} of max(|ref|, {FLOOR:g}));"
          f" {seconds:.1f} s")
    if counts["FAIL"]:
        for out in outputs:
            if out.strip():
                print("driver output:\n" + out[-4000:])
    if not args.keep and not args.out:
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(1 if counts["FAIL"] or not canary_caught else 0)


if __name__ == "__main__":
    main()
