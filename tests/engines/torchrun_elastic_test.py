#!/usr/bin/env python3
"""Two torchrun agents as two "nodes" on loopback: one joins, leaves, and comes back.

The job: tests/support/worker.cpp's `elastic-train` (a small MLP under hddp::Trainer),
one rank per agent, c10d rendezvous with --nnodes 1:2, each node with its own save
folder. The rendezvous store is a separate process (both agents `is_host=false`), as a
cluster's rendezvous endpoint outlives any one node.

0. Agent a starts alone and commits; agent b joins (a membership change: both restart
   counts are 0, so the generation finds the job's commits by the job's id).
1. The job trains at world 2 and commits into both folders.
2. Node b (its agent and its rank) is killed with SIGKILL.
3. Agent a's rank fails on the lost peer; the agent restarts it (a failure) at world 1;
   it resumes from the newest commit and trains on.
4. Agent b starts again with its old folder (which lacks the newest commits); agent a
   sees it waiting and restarts its rank (a membership change); the job re-forms at
   world 2, node b receives the newest commit over the communicator, and it ends rc 0.

Checked: both agents end with 0; every sample once per epoch over the steps of the last
generation that trained each; the steps trained twice are the ones the log counts; each
generation resumed from the newest commit any folder held; no step of a re-formed job
waited past the rendezvous timeouts; the final parameters equal an undisturbed run's
(hddp-run, 2 ranks). Every process this test starts is killed when it ends.
"""
import argparse
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

EPOCHS = 8          # 30 steps of 24 samples each (720 samples)
STEPS_PER_EPOCH = 30
SLEEP_MS = 60       # in each forward: a step of about 0.1 s
DEADLINE_S = 240    # the whole test

started = []        # Popen objects, killed at the end


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid):
    """pid's children, grandchildren, ... (from /proc)."""
    out = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in glob.glob(f"/proc/{p}/task/*/children"):
            try:
                with open(task) as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                kids = []
            out += kids
            todo += kids
    return out


def kill_tree(proc, sig=signal.SIGKILL):
    """Kills a process and everything it started (torchrun's ranks run in sessions of
    their own, so a process group is not enough)."""
    pids = descendants(proc.pid) + [proc.pid]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def start(cmd, log, env):
    f = open(log, "ab")
    p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                         start_new_session=True)
    started.append(p)
    return p


def commits(folder):
    steps = []
    for path in glob.glob(os.path.join(folder, "state-*.hddp")):
        m = re.search(r"state-(\d+)\.hddp$", path)
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps)


def wait_for(what, condition, timeout, procs=()):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a process ended first (rc {p.returncode})")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def steps_of(prefix):
    """Each step's samples (all ranks, sorted), from the last generation that trained it;
    and the trainings beyond the first (a step trained by 3 generations counts 2)."""
    lines = {}  # step -> {generation: [indices]}
    for path in glob.glob(prefix + ".rank*"):
        with open(path) as f:
            for line in f:
                fields = [int(x) for x in line.split()]
                if len(fields) < 3:
                    continue
                generation, step = fields[0], fields[1]
                lines.setdefault(step, {}).setdefault(generation, []).extend(fields[3:])
    out = {s: sorted(g[max(g)]) for s, g in lines.items()}
    repeated = sum(len(g) - 1 for g in lines.values())
    return out, repeated


def read(path):
    with open(path, errors="replace") as f:
        return f.read()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--torchrun", required=True)
    ap.add_argument("--python", required=True)
    ap.add_argument("--hddp-run", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--report", help="write the re-forming times here (JSON; bench/)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="hddp-torchrun-")
    t_start = time.monotonic()
    try:
        run(args, work, t_start)
    finally:
        for p in started:
            if p.poll() is None:
                kill_tree(p)
        for p in started:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if args.keep:
            print("work folder kept:", work)
        else:
            subprocess.call(["rm", "-rf", work])


def run(args, work, t_start):
    conf = ("is_host=false,join_timeout=120,last_call_timeout=2,close_timeout=10,"
            "keep_alive_interval=1,keep_alive_max_attempt=3")
    port = free_port()
    job = f"hddp-test-{os.getpid()}"
    env = dict(os.environ)
    env.update({
        "HDDP_LOG_LEVEL": "info",
        "HDDP_LOG_SAMPLES": os.path.join(work, "samples"),
        "OMP_NUM_THREADS": "1",
        "HDDP_DEVICE": "cpu",
        # Collectives give up on a lost peer within seconds (the default is minutes).
        "HDDP_TIMEOUT_SEC": env.get("HDDP_TIMEOUT_SEC", "30"),
        # torch 2.11's agents set up the workers' shared store once, in their first round,
        # and a node that joins a later round waits for its address forever: a store per
        # round instead, hosted by rank 0 (docs/cluster.md).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    })
    store = start([args.python, "-c",
                   "import datetime, time, torch.distributed as d\n"
                   f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, multi_tenant=True,"
                   " wait_for_workers=False, timeout=datetime.timedelta(seconds=300))\n"
                   "time.sleep(3600)\n"],
                  os.path.join(work, "store.log"), env)
    wait_for("the rendezvous store", lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0,
             60, [store])

    def agent(node):
        save = os.path.join(work, node, "save")
        os.makedirs(save, exist_ok=True)
        cmd = [args.torchrun, "--nnodes", "1:2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", job, "--rdzv-conf", conf, "--max-restarts", "3",
               "--monitor-interval", "0.5", "--no-python",
               args.worker, "elastic-train", work, save, str(EPOCHS), str(SLEEP_MS)]
        return start(cmd, os.path.join(work, node + ".log"), env), save

    t0 = time.time()
    a, save_a = agent("a")
    # 0. Node a alone, then node b joins (a membership change: both restart counts 0).
    wait_for("node a's first commits", lambda: commits(save_a) and max(commits(save_a)) >= 6,
             120, [a])
    joined_after = max(commits(save_a))
    b, save_b = agent("b")
    # 1. World 2, both folders commit (node b's first file is the commit it received).
    wait_for("a commit of the world-2 job in node b's folder",
             lambda: len(commits(save_b)) >= 2 and max(commits(save_b)) >= joined_after + 5,
             120, [a, b])
    # 2. Node b is lost.
    t_loss = time.monotonic()
    lost_wall = time.time()
    lost_at = max(commits(save_b))
    kill_tree(b)
    b.wait()
    print(f"node b killed at {t_loss - t_start:.1f} s (its newest commit: step {lost_at})")
    # 3. Node a goes on alone and commits past what b holds.
    wait_for("node a training alone past node b's commits",
             lambda: commits(save_a) and max(commits(save_a)) > max(commits(save_b)) + 10, 120, [a])
    t_back = time.monotonic()
    back_wall = time.time()
    b2, _ = agent("b")
    print(f"node b back at {t_back - t_start:.1f} s")
    # 4. The job re-forms at world 2 and ends.
    for name, p in (("a", a), ("b", b2)):
        left = DEADLINE_S - (time.monotonic() - t_start)
        try:
            p.wait(timeout=max(1, left))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent {name} still running at the deadline; logs in {work}")
    log_a, log_b = read(os.path.join(work, "a.log")), read(os.path.join(work, "b.log"))
    both = log_a + log_b
    assert a.returncode == 0 and b2.returncode == 0, (
        f"agents ended with {a.returncode} and {b2.returncode}\n--- a\n{log_a[-6000:]}\n--- b\n"
        f"{log_b[-6000:]}")
    total = EPOCHS * STEPS_PER_EPOCH
    assert f"trained {total} steps" in both, both[-4000:]
    # The generations: world 2, world 1 (after the loss), world 2 again (b's return).
    assert "a new generation of job" in both or "by the launcher: resumed" in both, both[-4000:]
    assert re.search(r"the newest commit, step \d+, was in 1 of 2 save folders; rank \d sent it",
                     both), "node b never received the newest commit\n" + both[-6000:]
    # Each resume took the newest commit that existed then: the steps resumed from are
    # commits of node a's folder (it kept training), increasing.
    # Rank 0 logs each resumption, on whichever node it is: both logs, in time order.
    timed = sorted(line for line in both.splitlines() if line.startswith("[20"))
    resumed = [int(s) for s in re.findall(r"resumed from \S+state-(\d+)\.hddp at step",
                                          "\n".join(timed))]
    assert len(resumed) >= 3, f"expected three resumptions, saw {resumed}\n" + both[-6000:]
    assert resumed == sorted(resumed), resumed
    assert resumed[0] >= joined_after, (resumed, joined_after)
    # The join resumed this job's commit at restart count 0 (by the job's id).
    assert "a new generation of job 'hddp-test-" in both, "\n" + both[-6000:]
    # Every sample once per epoch, over the steps of the generation that trained each last.
    trained, repeated = steps_of(os.path.join(work, "samples"))
    assert sorted(trained) == list(range(1, total + 1)), (
        f"steps trained: {len(trained)} of {total}")
    for epoch in range(EPOCHS):
        seen = []
        for step in range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1):
            seen += trained[step]
        assert sorted(seen) == list(range(720)), f"epoch {epoch}: samples not each once"
    # The log counts the steps trained again at each resumption (a rank killed between its
    # sample line and its progress mark leaves a count one short).
    counted = sum(int(n) for n in re.findall(r"are trained again \((\d+) steps\)", both))
    assert repeated - 1 <= counted <= repeated, (
        f"{repeated} steps trained twice, the log counts {counted}\n" + log_a[-6000:])
    # The same parameters as an undisturbed run (summation order aside).
    straight = os.path.join(work, "straight")
    os.makedirs(straight)
    env_straight = dict(env)
    env_straight.pop("HDDP_LOG_SAMPLES")
    env_straight["HDDP_LOG_LEVEL"] = "warn"
    r = subprocess.run([args.hddp_run, "--nproc-per-node", "2", "--", args.worker,
                        "elastic-train", straight, "-", str(EPOCHS), "0"],
                       env=env_straight, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    same = subprocess.run([args.worker, "same-params", os.path.join(work, "final.pt"),
                           os.path.join(straight, "final.pt")], capture_output=True, text=True)
    assert same.returncode == 0, "the parameters differ from an undisturbed run's: " + same.stdout
    # The times: from the agents' start, node b's loss and its return to the first step
    # of the generation that follows (rank 0's job record, in its own save folder).
    firsts = []
    for folder in (save_a, save_b):
        path = os.path.join(folder, "job.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                firsts += [json.loads(line)["t"] for line in f
                           if '"first_step"' in line]
    firsts.sort()

    def first_after(t):
        later = [f for f in firsts if f > t]
        return later[0] - t if later else None

    times = {"start_to_first_step_s": first_after(t0),
             "loss_to_first_step_s": first_after(lost_wall),
             "return_to_first_step_s": first_after(back_wall),
             "steps_trained_again": repeated, "rdzv_conf": conf,
             "monitor_interval_s": 0.5, "collective_timeout_s": int(env["HDDP_TIMEOUT_SEC"])}
    assert all(times[k] is not None for k in times if k.endswith("_s")), times
    print("times:", json.dumps(times))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(times, f)
    print(f"loss of node b -> steps trained again: {repeated} (the log counts {counted}); "
          f"resumed at steps {resumed}; {time.monotonic() - t_start:.1f} s in all")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print("FAILED:", e, file=sys.stderr)
        sys.exit(1)
    print("PASSED")
