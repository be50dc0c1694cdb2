#!/usr/bin/env python3
"""Differential matrix against PyTorch (issue #49, docs/reliability.md).

Draws seeded random configurations (world size 1-3 with a random split of every
micro-step, zero shares included; SGD with momentum/dampening/Nesterov/weight decay,
Adam, AdamW with or without amsgrad; ZeRO 0/1/2 with random shard weights; gradient
clipping; accumulation with noSync() micro-steps; a zoo of models: mlp, bn, syncbn, tied,
unused and their combinations; and more, see cases.py), trains each with hddp on N ranks (bench/diff_matrix, threads of one process) and
with PyTorch in one process on the whole batch (reference.py), and compares parameters,
buffers and optimizer state in float64.

  matrix.py --driver build/bench/diff_matrix --seed 1 --count 200   # random seeds
  matrix.py --driver build/bench/diff_matrix --ci                   # the fixed CI list
  matrix.py --driver build/bench/diff_matrix --seed 7 --count 1 --show --keep --out /tmp/c

One line per case (PASS / FAIL / KNOWN / XFAIL / XPASS, the configuration, the worst
differences), then a total. Exit code 1 when a case fails (a regression marked xfail,
or a drawn case of a known defect, KNOWN, does not count).
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
_PLAIN = {"micro": 1, "steps": 1, "optimizer": {"kind": "sgd", "momentum": 0.0, "dampening": 0.0,
                                                 "nesterov": False, "weight_decay": 0.0,
                                                 "second_group": None},
          "zero": {"stage": 0}, "clip": None, "scaler": None, "checkpoint": False,
          "broadcast": False, "frozen": None, "lr_decay": None, "empty_forward": False,
          "zero_grad_to_none": True}
_CROSSING = dict(_PLAIN, world=2, model="syncbn+unused", splits=[[[2, 2]]], heads=[[[True, False]]],
                 ddp={"first_bucket_bytes": 64, "bucket_cap_bytes": 25 << 20,
                      "gradient_as_bucket_view": True, "find_unused_parameters": True,
                      "rebuild_buckets": True, "buffer_sync": "with_gradients",
                      "buffer_sync_interval": 1})
REGRESSIONS = [
    # SyncBatchNorm + a head that rank 0 uses and rank 1 does not, findUnusedParameters,
    # two buckets (a 64-byte first bucket holding the head: as PyTorch's 1 MiB first
    # bucket beside a larger model). hddp marked the head ready only at the end of
    # backward on rank 1, so rank 1 sent the head's bucket after SyncBatchNorm's
    # backward allreduce and rank 0 before it: the collectives crossed. Here the head's
    # bucket (2x3 + 2) and SyncBatchNorm's backward statistics (2 x 4 channels) are both
    # 8 doubles: each was summed with the other, silently. Fixed: with
    # findUnusedParameters beside a SyncBatchNorm, buckets go out when backward ends
    # (test: SyncBatchNorm.AParameterUsedOnSomeRanksDoesNotCrossItsBackwardSums).
    {"seed": 1060, "fixed": dict(_CROSSING, dims={"in": 3, "hidden": 4, "out": 2}, loss="ce")},
    # The same with 6 channels: the crossed collectives differed in size, a hang (Gloo's
    # timeout) or an abort.
    {"seed": 1, "fixed": dict(_CROSSING, dims={"in": 2, "hidden": 6, "out": 3}, loss="mse")},
]

# Known hddp defects (each with its regression above): a drawn case that matches one and
# fails is counted KNOWN, not FAIL, so that a run of many seeds reports what is new.
# (None open: the entry is (name, predicate over a configuration).)
KNOWN = []


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


def finished(folder):
    """The driver is done with a case: every rank's file, or error.txt."""
    out = os.path.join(folder, "out")
    if os.path.exists(os.path.join(out, "error.txt")):
        return True
    with open(os.path.join(folder, "case.json")) as f:
        world = json.load(f)["world"]
    return all(os.path.exists(os.path.join(out, f"rank{r}.safetensors")) for r in range(world))


def drive(driver, folders, env):
    """Runs the driver over `folders`; when it dies (a collective mismatch that Gloo
    answers with std::terminate), the case it died in gets an error.txt with its output
    and a new driver goes on with the rest. Returns the outputs."""
    outputs = []
    while folders:
        p = subprocess.run([driver] + folders, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env=env)
        outputs.append(p.stdout)
        rest = [f for f in folders if not finished(f)]
        if not rest:
            break
        os.makedirs(os.path.join(rest[0], "out"), exist_ok=True)
        with open(os.path.join(rest[0], "out", "error.txt"), "w") as f:
            f.write(f"the driver died (exit code {p.returncode}): " + p.stdout[-600:].strip())
        folders = rest[1:]
    return "".join(outputs)


def run_driver(driver, folders, jobs):
    """Runs the driver over the case folders in `jobs` processes; returns their outputs."""
    chunks = [folders[i::jobs] for i in range(jobs) if folders[i::jobs]]
    env = dict(os.environ, HDDP_LOG_LEVEL=os.environ.get("HDDP_LOG_LEVEL", "error"),
               HDDP_TIMEOUT_SEC=os.environ.get("HDDP_TIMEOUT_SEC", "20"))
    with concurrent.futures.ThreadPoolExecutor(len(chunks)) as pool:
        return list(pool.map(lambda c: drive(driver, c, env), chunks))


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
    ap.add_argument("--model", help="pin the model of every drawn case: " + ", ".join(zoo.KINDS)
                    + " or parts joined by '+' (syncbn+tied+unused)")
    ap.add_argument("--world", type=int, choices=(1, 2, 3), help="pin the world size")
    args = ap.parse_args()
    torch.set_num_threads(1)
    driver = os.path.abspath(args.driver)
    if not os.access(driver, os.X_OK):
        sys.exit(f"no driver at {driver}: build it (ninja -C build diff_matrix) or pass --driver")

    if args.model:
        zoo.parts(args.model)  # an unknown part is an error here, not in the driver
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

    counts = {"PASS": 0, "FAIL": 0, "KNOWN": 0, "XFAIL": 0, "XPASS": 0}
    worst_abs = worst_rel = 0.0
    for (e, cfg, folder), want in zip(jobs, expected):
        ranks, error = read_ranks(folder, cfg["world"])
        if error is None:
            a, rel, problems = reference.compare(want, ranks, cfg["zero"]["stage"], RTOL, FLOOR)
            if not (e.get("xfail") or (problems and any(m(cfg) for _, m in KNOWN))):
                worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, rel)
            detail = f"max abs {a:.2e} rel {rel:.2e}"
        else:
            problems, detail = [f"driver: {error}"], "driver error"
        ok = not problems
        known = [name for name, matches in KNOWN if matches(cfg)]
        if e.get("xfail"):
            verdict, note = ("XPASS" if ok else "XFAIL"), f" | xfail: {e['xfail']}"
        elif not ok and known:
            verdict, note = "KNOWN", f" | known: {known[0]}"
        else:
            verdict, note = ("PASS" if ok else "FAIL"), ""
        counts[verdict] += 1
        print(f"{verdict:5} {cases.summary(cfg)} | {detail}{note}")
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
          + f"; worst abs {worst_abs:.2e}, rel {worst_rel:.2e} (tolerance rel {RTOL:g} of max(|ref|, {FLOOR:g}); XFAIL and KNOWN left out);"
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
