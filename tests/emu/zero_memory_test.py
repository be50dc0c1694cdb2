#!/usr/bin/env python3
"""ZeRO on the emulated accelerator, end to end through the Trainer (bench/zero_memory_bench
under hddp-run, 2 ranks on emu:0 and emu:1 with totals of 8 and 24 units of 4 MiB).

Checks, from each rank's own figures (emu's allocator counts every allocation):
- plain DDP: each rank holds Adam's whole state (8 bytes per parameter);
- ZeRO-2 by memory: the two parts add up to the whole state, the small card holds the
  smaller part, and its peak is its parameters + its part of gradients and state plus
  less than half a copy of the gradients (the buckets in flight): a foreign bucket's
  memory is given back once reduced;
- ZeRO-1 keeps every gradient: its peak holds parameters and gradients whole;
- the planner's memory caps: a rank with more state gets a smaller batch cap;
- a width that plain DDP cannot train on the small card (a rank out of memory ends the
  job, no hang) trains under ZeRO-2 by memory.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def run(args, zero, shard_by, width, extra=(), totals="8:24", steps=3, batch=8):
    cmd = [args.hddp_run, "--nproc-per-node", "2", "--", args.bench, "--zero", str(zero),
           "--shard-by", shard_by, "--width", str(width), "--layers", "24", "--totals", totals,
           "--unit-mib", "4", "--bucket-mib", "0.0625", "--global-batch", str(batch),
           "--steps", str(steps)]
    cmd += list(extra)
    env = {"HDDP_EMU_DEVICES": "2", "HDDP_LOG_LEVEL": "warn", "PATH": "/usr/bin:/bin"}
    # A sanitized build's options (scripts/sanitize.sh) reach the ranks too.
    env.update({k: v for k, v in os.environ.items() if k.endswith("SAN_OPTIONS")})
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    results = {}
    for line in p.stdout.splitlines():
        start = line.find("{")
        if start >= 0 and '"kind":"result"' in line:
            r = json.loads(line[start:])
            results[r["rank"]] = r
    return p, results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hddp-run", required=True)
    ap.add_argument("--bench", required=True)
    args = ap.parse_args()
    failures = []

    def check(cond, what):
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    width = 256
    plain_p, plain = run(args, 0, "equal", width)
    check(plain_p.returncode == 0 and len(plain) == 2, "plain DDP trains width 256")
    params = plain[0]["params"]
    check(all(plain[r]["state_bytes"] == 8 * params for r in (0, 1)),
          f"plain DDP: every rank holds Adam's whole state (8 x {params} bytes)")

    z2_p, z2 = run(args, 2, "memory", width)
    check(z2_p.returncode == 0 and len(z2) == 2, "ZeRO-2 by memory trains width 256")
    check(z2[0]["state_bytes"] + z2[1]["state_bytes"] == 8 * params,
          "ZeRO-2: the parts add up to the whole state")
    check(z2[0]["state_bytes"] < z2[1]["state_bytes"] / 2,
          f"ZeRO-2 by memory: the small card holds the smaller part "
          f"({z2[0]['state_bytes']} < {z2[1]['state_bytes']} / 2)")
    share0 = z2[0]["state_bytes"] / (8 * params)
    ideal0 = 4 * params + 12 * params * share0
    extra = z2[0]["peak_bytes"] - ideal0
    check(extra < 0.5 * 4 * params,
          f"ZeRO-2: the small card's peak {z2[0]['peak_bytes']} is its parameters and part "
          f"({ideal0:.0f}) plus {extra:.0f} bytes, less than half the gradients "
          f"({2 * params} bytes)")
    check(z2[0]["peak_bytes"] < plain[0]["peak_bytes"] * 0.6,
          f"ZeRO-2 by memory: the small card's peak {z2[0]['peak_bytes']} is under 0.6 x plain "
          f"DDP's {plain[0]['peak_bytes']}")

    z1_p, z1 = run(args, 1, "memory", width)
    check(z1_p.returncode == 0 and len(z1) == 2, "ZeRO-1 by memory trains width 256")
    check(z1[0]["peak_bytes"] >= 8 * params,
          "ZeRO-1 keeps the parameters and every gradient (peak >= 8 bytes per parameter)")
    check(z1[0]["state_bytes"] < z1[1]["state_bytes"], "ZeRO-1 by memory: the smaller part on "
          "the small card")

    big = 416  # 4.2 M parameters: 16 bytes each is twice the small card's 32 MiB
    big_plain_p, big_plain = run(args, 0, "equal", big)
    check(big_plain_p.returncode != 0 and not all(r.get("ok") for r in big_plain.values()),
          f"plain DDP at width {big} runs out of memory on the small card and the job ends "
          f"(exit {big_plain_p.returncode})")
    big_z2_p, big_z2 = run(args, 2, "memory", big)
    check(big_z2_p.returncode == 0 and len(big_z2) == 2 and all(r["ok"] for r in big_z2.values()),
          f"ZeRO-2 by memory trains width {big}")
    # The planner's memory caps come from each rank's measured memory, which holds its
    # part: on two equal cards, the rank holding 3/4 of the state gets the smaller cap.
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        caps_p, _ = run(args, 2, "1:3", 256, ["--balance", "--metrics", metrics], totals="16:16",
                        steps=14, batch=512)
        check(caps_p.returncode == 0, "ZeRO-2 1:3 with the planner on two equal cards trains")
        last = {}
        for rank, path in ((0, metrics), (1, os.path.join(tmp, "m.rank1.jsonl"))):
            steps = [json.loads(l) for l in open(path) if '"kind":"step"' in l.replace(" ", "")]
            last[rank] = steps[-1] if steps else {}
        caps = [last[r].get("memory", {}).get("cap_samples", -1) for r in (0, 1)]
        states = [last[r].get("optimizer_state_bytes", -1) for r in (0, 1)]
        check(states[1] > 2 * states[0] > 0, f"the metrics carry each rank's state {states}")
        check(0 < caps[1] < caps[0], f"the rank with more state gets the smaller memory cap {caps}")
    if failures:
        print(plain_p.stderr[-2000:], z2_p.stderr[-2000:], big_z2_p.stderr[-2000:], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
