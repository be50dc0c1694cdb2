#!/usr/bin/env python3
"""Two pods of deploy/pytorchjob.yaml's elastic PyTorchJob, on loopback.

Each "pod" is deploy/entrypoint.sh (the manifest's command, mapped from the image path
through deploy/Containerfile's COPY) with exactly the variables Kubeflow's training
operator gives the pods of that manifest (pytorchjob_manifest_test.operator_env, a port
of the operator's envvar.go/elastic.go), except the rendezvous endpoint: the operator's
<job>-worker-0:23456 becomes 127.0.0.1:<free port>, which is what the policy's rdzvHost
and rdzvPort fields would give. The pods run train_resnet on tiny synthetic settings
with HDDP_DEVICE=cpu and --save-dir in a folder both see (the shared volume).

PET_NNODES is the manifest's 1:2. torchrun's c10d rendezvous completes as soon as the
maximum has joined, so two pods started together do not wait its last_call_timeout
(30 s, which only applies while fewer than the maximum are in).

Checked:
  - the entry script refuses a pod without the operator's variables, one whose
    rendezvous is incomplete, and an unknown trainer: exit 2 naming what is wrong;
    it hands torchrun the variables untouched (PET_STANDALONE="" becomes 1) and the
    trainer with its arguments (a stand-in torchrun records them);
  - both pods exit 0 within the time limit, as one job: the ranks 0/2 and 1/2, one per
    pod, the trainer's "2 rank(s)", an initial plan of 2 entries summing to the global
    batch, all steps done, and state files in the shared --save-dir.
Every process a pod started is killed at the end, whatever happened: each pod runs in
its own process group, and torchrun's workers (in sessions of their own) are found by a
variable only this run's processes carry.

Usage: pytorchjob_entry_test.py --trainer PATH [--torchrun PATH] [--timeout S]
"""
import argparse
import copy
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pytorchjob_manifest_test as manifest  # noqa: E402  (yaml, operator_env, paths)

import yaml  # noqa: E402

TINY = ["--model", "resnet9", "--dataset", "synthetic", "--image-size", "16",
        "--global-batch", "32", "--max-steps", "20", "--workers", "0", "--threads", "1",
        "--progress", "lines", "--log-every", "10"]
GLOBAL_BATCH, STEPS = 32, 20
# Variables of other launchers that must not leak into the pods.
FOREIGN = re.compile(r"^(PET_|TORCHELASTIC_|SLURM_|OMPI_|PMI_|HDDP_)|^(MASTER_ADDR|MASTER_PORT|RANK|"
                     r"WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK)$")
TAG = "HDDP_TEST_PYTORCHJOB_POD"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env():
    return {k: v for k, v in os.environ.items() if not FOREIGN.search(k)}


def tagged_pids(tag):
    """Processes whose environment carries TAG=tag (ours only: the tag is a fresh uuid)."""
    pids = []
    needle = ("%s=%s" % (TAG, tag)).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open("/proc/%s/environ" % entry, "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            pass
    return pids


def stop(pods, tag):
    for p in pods:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)  # torchrun stops its workers on SIGTERM
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for p in pods:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        p.wait()
    for _ in range(50):
        left = tagged_pids(tag)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    print("warning: processes of this test still running: %s" % tagged_pids(tag))


class Checks:
    def __init__(self):
        self.failed = []
        self.passed = 0

    def expect(self, ok, what, detail=""):
        if ok:
            self.passed += 1
            print("ok: " + what)
        else:
            self.failed.append(what)
            print("FAIL: %s%s" % (what, ("\n" + detail) if detail else ""))


# ---------------------------------------------------------------------------------------

def entry_checks(checks, entry, trainer, operator, tmp):
    """The entry script's own behaviour, with a stand-in torchrun (no training)."""
    record = os.path.join(tmp, "torchrun.record")
    fake = os.path.join(tmp, "fake-torchrun")
    with open(fake, "w") as f:
        f.write("#!/bin/sh\n{ printf '%%s\\n' \"$@\"; env | grep '^PET_' | LC_ALL=C sort; "
                "env | grep '^TORCH_DISABLE_SHARE_RDZV_TCP_STORE=' || true; } > '%s'\n" % record)
    os.chmod(fake, 0o755)
    base = clean_env()
    base.update(HDDP_TORCHRUN=fake, HDDP_BIN=os.path.dirname(trainer))
    name = os.path.basename(trainer)

    def run(env, args):
        if os.path.exists(record):
            os.remove(record)
        r = subprocess.run([entry] + args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=30)
        return r.returncode, r.stdout

    rc, out = run(base, [name, "--help"])
    checks.expect(rc == 2 and "PET_NNODES is not set" in out,
                  "entry: a pod without the operator's variables exits 2 naming PET_NNODES", out)
    env = dict(base, **{k: v for k, v in operator.items() if k != "PET_RDZV_BACKEND"})
    rc, out = run(env, [name])
    checks.expect(rc == 2 and "PET_RDZV_BACKEND" in out,
                  "entry: an elastic pod without PET_RDZV_BACKEND exits 2 naming it", out)
    env = dict(base, PET_NNODES="2", PET_NPROC_PER_NODE="1")
    rc, out = run(env, [name])
    checks.expect(rc == 2 and "PET_RDZV_ENDPOINT" in out and "PET_MASTER_ADDR" in out,
                  "entry: PET_NNODES=2 with no rendezvous exits 2 naming both kinds", out)
    env = dict(base, **operator)
    rc, out = run(env, ["train_nothing", "--x"])
    checks.expect(rc == 2 and "train_nothing" in out,
                  "entry: an unknown trainer exits 2 naming it", out)
    rc, out = run(env, [name, "--max-steps", "3"])
    rec = open(record).read().splitlines() if os.path.exists(record) else []
    want = ["--no-python", os.path.join(os.path.dirname(trainer), name), "--max-steps", "3"]
    pet = sorted("%s=%s" % kv for kv in operator.items() if kv[0].startswith("PET_"))
    # A rendezvous store per round: torch 2.11's shared one never reaches a pod that joins
    # a later round (docs/cluster.md).
    pet.append("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    checks.expect(rc == 0 and rec[:4] == want and rec[4:] == pet,
                  "entry: torchrun gets --no-python, the trainer, its args and the PET_ variables as set",
                  "exit %d, output %r, torchrun saw %r, want %r" % (rc, out, rec, want + pet))
    rc, out = run(env, ["--max-steps", "3"])
    rec = open(record).read().splitlines() if os.path.exists(record) else []
    checks.expect(rc == 0 and rec[:4] == want,
                  "entry: the trainer is train_resnet when the first argument is an option",
                  "torchrun saw %r" % rec)
    env = dict(base, PET_NNODES="1", PET_NPROC_PER_NODE="1", PET_STANDALONE="")
    rc, out = run(env, [name])
    rec = open(record).read().splitlines() if os.path.exists(record) else []
    checks.expect(rc == 0 and "PET_STANDALONE=1" in rec,
                  "entry: the operator's PET_STANDALONE=\"\" reaches torchrun as 1", "torchrun saw %r" % rec)


def pod_args(container, shared):
    """The manifest's trainer with tiny settings instead of its own, but its --save-dir
    and --resume, moved from the shared volume's mount path to the folder `shared`."""
    args = list(container.get("args") or [])
    name = args.pop(0) if args and not args[0].startswith("-") else "train_resnet"
    mounts = [m["mountPath"].rstrip("/") for m in container.get("volumeMounts") or []]
    kept = []
    for opt in ("--save-dir", "--resume"):
        value = manifest.option_value(args, opt)
        if value is not None:
            for m in mounts:
                if value == m or value.startswith(m + "/"):
                    value = shared + value[len(m):]
            kept += [opt, value]
    return [name] + TINY + kept, manifest.option_value(kept, "--save-dir")


def two_pods(checks, entry, trainer, torchrun, operator_of, container, tmp, timeout):
    port = free_port()
    operator = operator_of("127.0.0.1", port)
    shared = os.path.join(tmp, "shared")
    os.makedirs(shared)
    args, save_dir = pod_args(container, shared)
    checks.expect(save_dir is not None and save_dir.startswith(shared + "/"),
                  "manifest: --save-dir is on the shared volume (%s here)" % save_dir)
    save_dir = save_dir or os.path.join(shared, "none")
    tag = uuid.uuid4().hex
    pods, logs = [], []
    print("pods: %s %s\n  with %s" % (entry, " ".join(args),
                                      " ".join("%s=%s" % kv for kv in sorted(operator.items()))))
    start = time.monotonic()
    try:
        for i in range(2):
            env = clean_env()
            env.update(operator)
            env.update(HDDP_DEVICE="cpu", HDDP_TORCHRUN=torchrun, HDDP_BIN=os.path.dirname(trainer))
            env[TAG] = tag
            log = open(os.path.join(tmp, "pod%d.log" % i), "w+")
            logs.append(log)
            pods.append(subprocess.Popen([entry] + args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True))
        codes = []
        for p in pods:
            try:
                codes.append(p.wait(timeout=max(1, timeout - (time.monotonic() - start))))
            except subprocess.TimeoutExpired:
                codes.append(None)
        elapsed = time.monotonic() - start
    finally:
        stop(pods, tag)
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    both = "\n".join(outs)
    detail = "\n".join("---- pod %d (exit %s) ----\n%s" % (i, codes[i] if i < len(codes) else "?", o[-6000:])
                       for i, o in enumerate(outs))
    checks.expect(codes == [0, 0], "pods: both exit 0 within %d s (took %.1f s, exits %s)"
                  % (timeout, elapsed, codes), detail)
    checks.expect(all("hddp-entrypoint: torchrun --no-python" in o for o in outs),
                  "pods: each ran the entry script's torchrun", detail)
    ranks = [sorted(set(re.findall(r"\brank (\d+)/(\d+) \(local 0/1\) from torchrun", o))) for o in outs]
    checks.expect(sorted(r for rs in ranks for r in rs) == [("0", "2"), ("1", "2")]
                  and all(len(rs) == 1 for rs in ranks),
                  "pods: one job of world size 2, one rank per pod (ranks seen: %s)" % ranks, detail)
    checks.expect(re.search(r"train_resnet: resnet9 on synthetic, 2 rank\(s\)", both) is not None,
                  "pods: the trainer reports 2 ranks", detail)
    plan = re.search(r"initial plan \[(\d+), (\d+)\] of (\d+)", both)
    checks.expect(plan is not None and int(plan.group(1)) + int(plan.group(2)) == GLOBAL_BATCH
                  and int(plan.group(3)) == GLOBAL_BATCH,
                  "pods: the planner splits the global batch %d in 2 entries (%s)"
                  % (GLOBAL_BATCH, plan.group(0) if plan else "no plan line"), detail)
    checks.expect(re.search(r"done: %d steps" % STEPS, both) is not None,
                  "pods: all %d steps trained" % STEPS, detail)
    saved = sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []
    checks.expect(len(saved) > 0, "pods: state saved in the shared --save-dir (%s)" % ", ".join(saved), detail)


def main():
    # A SIGTERM (ctest's timeout, Ctrl-C's kin) still runs the pods' clean-up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trainer", required=True, help="train_resnet of the build")
    ap.add_argument("--torchrun", default=shutil.which("torchrun") or os.path.join(
        os.path.dirname(sys.executable), "torchrun"))
    ap.add_argument("--repo", default=manifest.REPO)
    ap.add_argument("--timeout", type=float, default=120, help="seconds the two pods may take")
    opts = ap.parse_args()
    repo = os.path.abspath(opts.repo)
    trainer = os.path.abspath(opts.trainer)
    torchrun = os.path.abspath(opts.torchrun)

    with open(os.path.join(repo, manifest.MANIFEST)) as f:
        docs = list(yaml.safe_load_all(f))
    with open(os.path.join(repo, manifest.CONTAINERFILE)) as f:
        image_entry = manifest.entry_path_in_image(f.read())
    job = manifest.job_of(docs)
    container = manifest.container_of(docs)
    checks = Checks()
    command = container.get("command") or []
    checks.expect(command == [image_entry],
                  "manifest: the command %s is the image's entry script %s" % (command, image_entry))
    entry = os.path.join(repo, manifest.ENTRY_SCRIPT)

    def operator_of(host, port):
        j = copy.deepcopy(job)
        j["spec"]["elasticPolicy"].update(rdzvHost=host, rdzvPort=port)
        return manifest.operator_env(j, "Worker", 0)

    operator = operator_of("127.0.0.1", 1)
    j = copy.deepcopy(job)
    j["spec"]["elasticPolicy"].update(rdzvHost="127.0.0.1", rdzvPort=1)
    checks.expect(manifest.operator_env(j, "Worker", 1) == operator,
                  "operator: pod Worker-1 gets the same variables as Worker-0 (an elastic job's pods do)")
    checks.expect(operator.get("PET_RDZV_BACKEND") == "c10d" and re.fullmatch(r"\d+:\d+", operator.get("PET_NNODES", "")),
                  "operator: c10d rendezvous and PET_NNODES=MIN:MAX (%s)" % operator.get("PET_NNODES"))

    with tempfile.TemporaryDirectory(prefix="hddp-pytorchjob-entry-") as tmp:
        entry_checks(checks, entry, trainer, operator, tmp)
        two_pods(checks, entry, trainer, torchrun, operator_of, container, tmp, opts.timeout)
    print("pytorchjob_entry_test: %d checks passed, %d failed" % (checks.passed, len(checks.failed)))
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
