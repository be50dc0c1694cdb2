#!/usr/bin/env python3
"""What-if against measurement: hddp-probe --what-if's predicted samples/s and split
for emulated mixes, next to what the ResNet trainer measures with the same emulation.

The model is the main job's (ResNet-9 at a quarter width, Fashion-MNIST 1x28x28, global
batch 256, momentum SGD). The prediction comes from a calibration of the model on this
machine with one thread (the thread each of 2 ranks gets on 2 cores), and a device table
written for the run:
  - cpu1t: this machine's one thread (the figures are a stand-in: only the ratios
    between entries count, and the calibration was made on this entry);
  - cpu1t-xK: the same stretched K times (compute and memory bandwidth), as
    --emulate-slowdown K does;
  - emul-G: a G GB/s input link as --emulate-link-gbps G (slept after the step, so the
    prediction runs with --no-prefetch); host: a CPU rank's input is already in memory.
The gradient ring runs over loopback (--allreduce-gbps, measured by bench/allreduce_bench
would be better; the ResNet-9's 2.6 MB of gradients are ~1% of a step either way).

Each case: the trainer runs --steps steps under hddp-run; measured samples/s = global
batch / the median step time of the last half of the steps, the split = the last step's
plan. Errors: samples/s relative, the largest share's absolute difference as a fraction
of B; --rounds rounds (each with its own calibration), the median round per case shown.

  bench/what_if_check.py --build build [--steps 60] [--cases 2a,2b,3] [--rounds 3]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CASES = {
    "2a": {"slowdown": [1, 2], "link": [0, 0]},
    "2b": {"slowdown": [1, 1.5], "link": [0, 0.01]},
    "3": {"slowdown": [1, 2, 3], "link": [0, 0, 0]},
}
ALLREDUCE_GBPS = 1.0  # Gloo over loopback on this machine, order of magnitude


def table(cases):
    devices = {"cpu1t": {"name": "this machine, 1 thread", "fp32_tflops": 1.0, "fp16_tflops": 0,
                         "bf16_tflops": 0, "memory_gib": 24, "memory_GBps": 10,
                         "source": "stand-in for the calibrated thread (ratios count)"}}
    links = {"host": {"name": "host memory", "GBps": 1000, "source": "no copy (CPU rank)"}}
    for c in cases.values():
        for k in c["slowdown"]:
            if k != 1:
                devices[f"cpu1t-x{k}"] = dict(devices["cpu1t"], name=f"cpu1t {k}x slower",
                                              fp32_tflops=1.0 / k, memory_GBps=10.0 / k,
                                              source="--emulate-slowdown " + str(k))
        for g in c["link"]:
            if g:
                links[f"emul-{g}"] = {"name": f"emulated {g} GB/s", "GBps": g,
                                      "source": "--emulate-link-gbps " + str(g)}
    return {"devices": devices, "links": links}


def mix(case):
    items = []
    for k, g in zip(case["slowdown"], case["link"]):
        items.append(("cpu1t" if k == 1 else f"cpu1t-x{k}") + "@" + (f"emul-{g}" if g else "host"))
    return ",".join(items)


def rank_list(values, default):
    return ",".join(f"{r}:{v}" for r, v in enumerate(values) if v != default)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--cases", default="2a,2b,3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default=os.environ.get("HDDP_FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))
    args = ap.parse_args()
    probe = os.path.join(args.build, "tools", "hddp-probe", "hddp-probe")
    launcher = os.path.join(args.build, "tools", "hddp-run", "hddp-run")
    trainer = os.path.join(args.build, "examples", "resnet", "train_resnet")
    cases = {k: CASES[k] for k in args.cases.split(",")}
    work = tempfile.mkdtemp(prefix="hddp-what-if-")
    with open(os.path.join(work, "table.json"), "w") as f:
        json.dump(table(cases), f)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results = {name: [] for name in cases}
    for rnd in range(args.rounds):
        profile = os.path.join(work, f"resnet9-{rnd}.json")
        subprocess.run([probe, "--what-if", "cpu1t@host", "--device-table", os.path.join(work, "table.json"),
                        "--model", "resnet9", "--input", "1x28x28", "--calibrate", "cpu1t", "--calibrate-device",
                        "cpu", "--calibration-batch", "128", "--save-profile", profile], env=env, check=True,
                       capture_output=True)
        p = json.load(open(profile))
        print(f"round {rnd + 1}: calibrated {p['calibration']['seconds_per_sample'] * 1e3:.3f} ms/sample + "
              f"{p['calibration']['fixed_seconds'] * 1e3:.1f} ms a step on one thread; "
              f"{p['train_flops_per_sample'] / 1e6:.1f} MFLOPs/sample, {p['parameter_bytes'] / 1e6:.2f} MB of "
              f"parameters", flush=True)
        for name, case in cases.items():
            results[name].append(run_case(args, probe, launcher, trainer, work, env, profile, name, case, rnd))
    print(f"median of {args.rounds} round(s)")
    print(f"{'case':5} {'mix':45} {'pred s/s':>9} {'meas s/s':>9} {'error':>6}  {'pred split':16} {'meas split':16} share err")
    rows = []
    for name, rs in results.items():
        r = sorted(rs, key=lambda x: x["samples_error"])[len(rs) // 2]
        rows.append(r)
        print(f"{name:5} {r['mix']:45} {r['predicted_samples_per_s']:9.0f} {r['measured_samples_per_s']:9.0f} "
              f"{100 * r['samples_error']:5.1f}%  {str(r['predicted_split']):16} {str(r['measured_split']):16} "
              f"{100 * r['share_error']:.1f}% of B  (rounds: "
              + ", ".join(f"{100 * x['samples_error']:.1f}%" for x in rs) + ")")
    print(json.dumps({"kind": "what_if_check", "rounds": results}))


def run_case(args, probe, launcher, trainer, work, env, profile, name, case, rnd):
    n = len(case["slowdown"])
    pred = json.loads(subprocess.run(
        [probe, "--what-if", mix(case), "--device-table", os.path.join(work, "table.json"), "--profile", profile,
         "--global-batch", str(args.global_batch), "--no-prefetch", "--allreduce-gbps", str(ALLREDUCE_GBPS),
         "--json"], env=env, check=True, capture_output=True, text=True).stdout)
    metrics = os.path.join(work, f"metrics-{name}-{rnd}.jsonl")
    cmd = [launcher, "--nproc-per-node", str(n), "--no-tty", "--", trainer, "--model", "resnet9",
           "--dataset", "fashion-mnist", "--data", args.data, "--global-batch", str(args.global_batch),
           "--max-steps", str(args.steps), "--eval-every", "1000", "--limit-test", "256", "--workers", "0",
           "--log-every", "1", "--progress", "off", "--metrics", metrics]
    slow = rank_list(case["slowdown"], 1)
    link = rank_list(case["link"], 0)
    if slow:
        cmd += ["--emulate-slowdown", slow]
    if link:
        cmd += ["--emulate-link-gbps", link]
    subprocess.run(cmd, env=dict(os.environ), check=True, capture_output=True)
    steps = [json.loads(l) for l in open(metrics)]
    steps = [s for s in steps if s.get("kind") == "step" and s["rank"] == 0]
    late = steps[len(steps) // 2:]
    measured = args.global_batch / statistics.median(s["step_s"] for s in late)
    plan = late[-1]["plan"]
    predicted = pred["samples_per_s"]
    share_error = max(abs(a - b) for a, b in zip(pred["split"], plan)) / args.global_batch
    return {"case": name, "mix": mix(case), "predicted_samples_per_s": predicted, "measured_samples_per_s": measured,
            "samples_error": abs(predicted - measured) / measured, "predicted_split": pred["split"],
            "measured_split": plan, "share_error": share_error}


if __name__ == "__main__":
    sys.exit(main())
