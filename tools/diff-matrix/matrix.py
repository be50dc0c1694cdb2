#!/usr/bin/env python3
"""Differential matrix against PyTorch (issue #49, docs/reliability.md).

Draws seeded random configurations (world size 1-3 with a random split of every
micro-step, zero shares included; SGD with momentum/dampening/Nesterov/weight decay,
Adam, AdamW with or without amsgrad; ZeRO 0/1/2 with random shard weights; gradient
clipping; accumulation with noSync() micro-steps; a zoo of models: mlp, bn, syncbn, tied,
unused and their combinations; fp16/bf16 gradient compression, PowerSGD, bf16 autocast,
a save and a resume on another world size; and more, see cases.py), trains each with
hddp on N ranks (bench/diff_matrix, threads of one process) and with PyTorch: in one
process on the whole batch (reference.py), rank by rank where hddp's reduction rounds
(reference_ranks.py), or under torch's own DDP and powerSGD_hook on N processes
(reference_powersgd.py); and compares parameters, buffers and optimizer state.

  matrix.py --driver build/bench/diff_matrix --seed 1 --count 200   # random seeds
  matrix.py --driver build/bench/diff_matrix --ci                   # the fixed CI list
  matrix.py --driver build/bench/diff_matrix --seed 7 --count 1 --show --keep --out /tmp/c
  matrix.py --driver build/bench/diff_matrix --count 300 --pin 'compression={"kind": "powersgd"}'

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
import reference_powersgd  # noqa: E402
import reference_ranks  # noqa: E402
import zoo  # noqa: E402

# Per tensor: max |hddp - reference| <= RTOL x max(max |reference|, FLOOR). The floor
# keeps tensors whose reference is ~0 (a momentum of zero gradients) from asking for
# more than 1e-14 absolute.
RTOL = 1e-9
FLOOR = 1e-5
# bf16 autocast (float32 model): see tolerance() and docs/reliability.md.
RTOL_AUTOCAST = 1e-9
RTOL_POWERSGD = 1e-5

# Disagreements found by the matrix, kept as fixed configurations (seed + pinned keys).
# "xfail": the reason, while hddp is not fixed; the case then reports XFAIL (or XPASS
# once it passes) and does not fail the run. Remove "xfail" when hddp is fixed.
_PLAIN = {"micro": 1, "steps": 1, "optimizer": {"kind": "sgd", "momentum": 0.0, "dampening": 0.0,
                                                 "nesterov": False, "weight_decay": 0.0,
                                                 "second_group": None},
          "zero": {"stage": 0}, "clip": None, "scaler": None, "checkpoint": False,
          "broadcast": False, "frozen": None, "lr_decay": None, "empty_forward": False,
          "zero_grad_to_none": True, "compression": None, "autocast": False, "resume": None}
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
    # PowerSGD on float64 gradients against torch's powerSGD_hook as it is (P and Q summed
    # in float64): hddp cast P and Q to float32 for their allreduces (wireType's default
    # was at::kFloat and at::kDouble was refused), ~1e-8 relative off torch even on 2
    # ranks. Fixed: P and Q travel in the gradients' type unless wireType names another
    # (test: PowerSgd.FactorsTravelInTheGradientsTypeByDefault).
    {"seed": 2004, "fixed": dict(_PLAIN, world=2, model="mlp", steps=3,
                                 dims={"in": 6, "hidden": 8, "out": 3},
                                 splits=[[[2, 2]]] * 3, heads=None, loss="mse",
                                 compression={"kind": "powersgd", "rank": 1, "start": 2,
                                              "error_feedback": True, "warm_start": True, "seed": 7})},
    # PowerSGD across a save and a resume: the resumed DDP starts from its initial bucket
    # order (reverse registration) and rebuilds after its first step, while the loaded
    # PowerSgdState (and the memories it makes in that first step) held the error and Q
    # memories per bucket index, of the same size: added to the wrong elements without
    # a word. Activation checkpointing (of the tied block here; of fc2 in mlp) makes the
    # observed order differ from the initial one. (A straight run starts compressing
    # after the rebuild.) Fixed: the memories are kept per parameter (test:
    # PowerSgdResume.MemoriesFollowTheirParametersWhenTheBucketsAreLaidOutAnew).
    {"seed": 3001, "fixed": dict(_PLAIN, world=2, model="tied", steps=4, checkpoint=True,
                                 dims={"in": 4, "hidden": 6, "out": 2}, splits=[[[2, 2]]] * 4,
                                 heads=None, loss="mse",
                                 compression={"kind": "powersgd", "rank": 1, "start": 2,
                                              "error_feedback": True, "warm_start": True, "seed": 7},
                                 resume={"at": 2, "world": 2, "weights": []})},
]

# Known hddp defects (each with its regression above): a drawn case that matches one and
# fails is counted KNOWN, not FAIL, so that a run of many seeds reports what is new.
# (Each entry: (name, predicate over a configuration).) None open.
KNOWN = []


_OFF = {"compression": None, "autocast": False, "resume": None}  # the axes of version 2

# The axes of version 2 in the CI list: (seed, pinned keys).
_CI_V2 = [
    (2001, dict(world=3, model="mlp", compression={"kind": "fp16"}, autocast=False, resume=None)),
    (2002, dict(world=2, model="unused", optimizer={"kind": "adam"}, compression={"kind": "fp16"},
                autocast=False, resume=None)),
    (2003, dict(world=3, model="tied", micro=2, compression={"kind": "bf16"}, autocast=False,
                resume=None, scaler={"init_scale": 1024.0, "growth_interval": 1,
                                     "overflow_step": None, "overflow_rank": 0})),
    (2004, dict(world=3, model="mlp", steps=4, compression={"kind": "powersgd", "rank": 1, "start": 2,
                                                             "error_feedback": True, "warm_start": True},
                autocast=False, resume=None)),
    (2005, dict(world=3, model="tied", steps=4, compression={"kind": "powersgd", "rank": 3, "start": 2,
                                                              "error_feedback": True, "warm_start": False},
                autocast=False, resume={"at": 3}, checkpoint=False)),
    (2006, dict(world=2, model="mlp", micro=2, autocast=True, compression=None, resume=None)),
    (2007, dict(world=3, model="tied+unused", autocast=True, compression={"kind": "bf16"},
                resume=None)),
    (2008, dict(world=2, model="mlp", steps=3, optimizer={"kind": "adam"}, zero={"stage": 2},
                compression=None, autocast=False, resume={"at": 1, "world": 3})),
    (2009, dict(world=3, model="syncbn", steps=3, compression=None, autocast=False,
                resume={"at": 2, "world": 1})),
    (2010, dict(world=1, model="bn", steps=3, optimizer={"kind": "sgd"}, compression={"kind": "fp16"},
                autocast=False, resume={"at": 1, "world": 3})),
    # P and Q cast to float32 for their allreduces (PowerSgdOptions::wireType = kFloat).
    (2011, dict(world=3, model="mlp", steps=4, compression={"kind": "powersgd", "rank": 2, "start": 2,
                                                             "error_feedback": True, "warm_start": True,
                                                             "wire": "float32"},
                autocast=False, resume=None)),
]


def ci_list():
    """About 30 fixed configurations: every zoo model with every optimizer kind, ZeRO
    0/1/2, no accumulation and 2-3 micro-steps, world sizes 1-3; the rest drawn from
    each seed (split, options, clipping, buckets). Then one or more configurations of each
    axis of version 2 (fp16/bf16 compression, PowerSGD, bf16 autocast, a resume into
    another world size), and the regressions."""
    variants = [("sgd", 0, 1), ("adam", 1, 2), ("adamw", 2, 1), ("sgd", 2, 3), ("adam", 0, 2),
                ("sgd", 1, 1)]
    entries = []
    for i, model in enumerate(zoo.KINDS):
        for j, (opt, stage, micro) in enumerate(variants):
            world = 1 + (i + j) % 3 if (i + j) % 4 else 3
            entries.append({"seed": 1000 + 10 * i + j, "fixed": dict(_OFF, **{
                "model": model, "world": world, "micro": micro, "optimizer": {"kind": opt},
                "zero": {"stage": stage}})})
    entries += [{"seed": seed, "fixed": fixed} for seed, fixed in _CI_V2]
    return entries + REGRESSIONS


def tolerance(cfg):
    """The relative tolerance of a case: RTOL in float64; RTOL_POWERSGD with PowerSGD's P
    and Q sent in float32 on 3 ranks (reference_powersgd.py); RTOL_AUTOCAST under bf16
    autocast (a float32 model). docs/reliability.md derives them."""
    if cfg.get("autocast"):
        return RTOL_AUTOCAST
    c = cfg.get("compression") or {}
    if c.get("kind") == "powersgd" and c.get("wire") == "float32" and \
            any(cases.world_of(cfg, s) > 2 for s in range(len(cfg["splits"]))):
        return RTOL_POWERSGD
    return RTOL


def finished(folder):
    """The driver is done with a case: every rank's file, or error.txt."""
    out = os.path.join(folder, "out")
    if os.path.exists(os.path.join(out, "error.txt")):
        return True
    with open(os.path.join(folder, "case.json")) as f:
        world = cases.final_world(json.load(f))
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
    ap.add_argument("--pin", action="append", default=[], metavar="KEY=JSON",
                    help="pin a configuration key of every drawn case (repeatable): "
                         "autocast=true, compression='{\"kind\": \"powersgd\"}', resume='{}'")
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
        for pin in args.pin:
            key, _, value = pin.partition("=")
            pinned[key] = json.loads(value)
        entries = []
        for seed in range(args.seed, args.seed + args.count):
            try:
                cases.draw(seed, **pinned)
            except AssertionError:  # a pinned axis that this seed's configuration cannot take
                continue
            entries.append({"seed": seed, "fixed": pinned})
        if not entries:
            sys.exit("no seed of the range can take the pinned keys")
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
    # The references are computed while the driver runs (two cores: one each); those
    # that need hddp's bucket layout (a rounded sum on 3 ranks) once it is done.
    later = {i for i, (_, cfg, _) in enumerate(jobs) if reference_ranks.needs_layout(cfg)}
    powersgd = [i for i, (_, cfg, _) in enumerate(jobs)
                if (cfg["compression"] or {}).get("kind") == "powersgd"]
    expected = [None] * len(jobs)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        driving = pool.submit(run_driver, driver, [f for _, _, f in jobs], max(1, args.jobs))
        for i, (_, cfg, folder) in enumerate(jobs):
            if i not in later and i not in powersgd:
                expected[i] = reference.train(cfg, load_file(os.path.join(folder, "data.safetensors")),
                                              args.plant_lr)
        if powersgd:
            got = reference_powersgd.run([jobs[i][1:] for i in powersgd], args.plant_lr)
            for i in powersgd:
                expected[i] = got[jobs[i][2]]
        outputs = driving.result()
    for i in sorted(later):
        _, cfg, folder = jobs[i]
        layout = os.path.join(folder, "out", "layout.json")
        if os.path.exists(layout):
            with open(layout) as f:
                expected[i] = reference.train(cfg, load_file(os.path.join(folder, "data.safetensors")),
                                              args.plant_lr, json.load(f))
        else:
            expected[i] = "no bucket layout from the driver"

    counts = {"PASS": 0, "FAIL": 0, "KNOWN": 0, "XFAIL": 0, "XPASS": 0}
    worst = {}  # "float64" / "autocast" -> (worst abs, worst rel) of the cases that count
    for (e, cfg, folder), want in zip(jobs, expected):
        ranks, error = read_ranks(folder, cases.final_world(cfg))
        if error is None and isinstance(want, str):
            problems, detail = [f"reference: {want}"], "reference error"
        elif error is None:
            a, rel, problems = reference.compare(want, ranks, cfg["zero"]["stage"], tolerance(cfg), FLOOR)
            if not (e.get("xfail") or (problems and any(m(cfg) for _, m in KNOWN))):
                kind = "autocast" if cfg.get("autocast") else \
                    "powersgd on 3 ranks" if tolerance(cfg) == RTOL_POWERSGD else "float64"
                wa, wr = worst.get(kind, (0.0, 0.0))
                worst[kind] = (max(wa, a), max(wr, rel))
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
        ranks, error = read_ranks(folder, cases.final_world(cfg))
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
    tolerances = {"float64": RTOL, "autocast": RTOL_AUTOCAST, "powersgd on 3 ranks": RTOL_POWERSGD}
    print(f"total {len(jobs)}: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v) + "; worst "
          + "; ".join(f"{k} abs {a:.2e} rel {r:.2e} (tolerance rel {tolerances[k]:g})"
                      for k, (a, r) in sorted(worst.items()))
          + f" (of max(|ref|, {FLOOR:g}); XFAIL and KNOWN left out); {seconds:.1f} s")
    if counts["FAIL"]:
        for out in outputs:
            if out.strip():
                print("driver output:\n" + out[-4000:])
    if not args.keep and not args.out:
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(1 if counts["FAIL"] or not canary_caught else 0)


if __name__ == "__main__":
    main()
