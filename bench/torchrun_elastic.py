#!/usr/bin/env python3
"""Re-forming under torchrun's elastic agent (docs/cluster.md): two agents as two nodes on
loopback, one rank each, c10d rendezvous (--nnodes 1:2), a save folder per node. Node b is
killed (SIGKILL, agent and rank) and started again; tests/engines/torchrun_elastic_test.py
runs the job and measures, from rank 0's job record:
  - start:  the agents' start to the job's first step (the cold start, the peer);
  - loss:   node b's loss to the first step of the generation without it;
  - return: node b's agent starting again to the first step of the generation with it;
and the steps trained again. Prints each round and the medians, with the ratio of each
re-forming to the cold start.

  HDDP_PYTHON=/opt/hddp-venv/bin/python bench/torchrun_elastic.py BUILD_DIR [ROUNDS]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    build = os.path.abspath(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    python = os.environ.get("HDDP_PYTHON", sys.executable)
    here = os.path.dirname(os.path.abspath(__file__))
    test = os.path.join(here, "..", "tests", "engines", "torchrun_elastic_test.py")
    results = []
    for i in range(rounds):
        with tempfile.NamedTemporaryFile(suffix=".json") as report:
            r = subprocess.run(
                [python, test, "--worker", os.path.join(build, "tests", "hddp_test_worker"),
                 "--torchrun", os.path.join(os.path.dirname(python), "torchrun"),
                 "--python", python, "--hddp-run",
                 os.path.join(build, "tools", "hddp-run", "hddp-run"), "--report", report.name],
                capture_output=True, text=True, timeout=400)
            if r.returncode != 0:
                sys.exit(f"round {i + 1} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
            with open(report.name) as f:
                results.append(json.load(f))
        t = results[-1]
        print(f"round {i + 1}: start {t['start_to_first_step_s']:.1f} s, "
              f"loss {t['loss_to_first_step_s']:.1f} s, "
              f"return {t['return_to_first_step_s']:.1f} s, "
              f"{t['steps_trained_again']} step(s) trained again", flush=True)
    med = {k: statistics.median(r[k] for r in results)
           for k in ("start_to_first_step_s", "loss_to_first_step_s", "return_to_first_step_s")}
    first = results[0]
    print(f"settings: --rdzv-conf {first['rdzv_conf']}, --monitor-interval "
          f"{first['monitor_interval_s']}, HDDP_TIMEOUT_SEC={first['collective_timeout_s']}, "
          f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    print(f"median of {rounds}: cold start {med['start_to_first_step_s']:.1f} s; "
          f"loss to first step {med['loss_to_first_step_s']:.1f} s "
          f"({med['loss_to_first_step_s'] / med['start_to_first_step_s']:.2f}x the cold start); "
          f"return to first step {med['return_to_first_step_s']:.1f} s "
          f"({med['return_to_first_step_s'] / med['start_to_first_step_s']:.2f}x)")


if __name__ == "__main__":
    main()
