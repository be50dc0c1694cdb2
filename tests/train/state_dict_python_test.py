#!/usr/bin/env python3
"""State dicts between hddp and Python, as a user takes a model across: torch.save's
.pt and safetensors written by Python are read by hddp (the test worker's
state-dict-copy) and written again in both formats, which Python's torch.load
(weights_only=True) and safetensors read back equal, dtypes and BatchNorm's buffers
included; a module loads hddp's file with load_state_dict(strict=True)."""
import argparse
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file


def make():
    return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.Flatten(),
                               torch.nn.Linear(3 * 4 * 4, 5)).double()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    args = ap.parse_args()
    d = tempfile.mkdtemp()
    torch.manual_seed(0)
    m = make()
    m.train()
    m(torch.randn(2, 1, 6, 6, dtype=torch.double))  # running statistics and num_batches_tracked
    sd = m.state_dict()
    sd["extra_half"] = torch.randn(3, 2).half().t()  # non-contiguous, float16
    sd["extra_bf16"] = torch.randn(4).bfloat16()
    torch.save(sd, f"{d}/py.pt")
    save_file({k: v.contiguous() for k, v in sd.items()}, f"{d}/py.safetensors")
    failures = 0
    for src in ("py.pt", "py.safetensors"):
        for out in ("hddp.pt", "hddp.safetensors"):
            r = subprocess.run([args.worker, "state-dict-copy", f"{d}/{src}", f"{d}/{out}"],
                               capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                print(f"FAIL {src} -> {out}: {r.stderr[-800:]}")
                failures += 1
                continue
            got = torch.load(f"{d}/{out}", weights_only=True) if out.endswith(".pt") else load_file(f"{d}/{out}")
            same = set(got) == set(sd) and all(
                torch.equal(got[k], sd[k]) and got[k].dtype == sd[k].dtype for k in sd)
            print(("ok   " if same else "FAIL ") + f"{src} -> hddp -> {out}: {len(got)} tensors")
            failures += not same
    m2 = make()
    del sd["extra_half"], sd["extra_bf16"]
    torch.save(sd, f"{d}/model.pt")
    subprocess.run([args.worker, "state-dict-copy", f"{d}/model.pt", f"{d}/model_hddp.pt"], check=True,
                   capture_output=True, timeout=120)
    m2.load_state_dict(torch.load(f"{d}/model_hddp.pt", weights_only=True), strict=True)
    same = all(torch.equal(a, b) for a, b in zip(m2.state_dict().values(), m.state_dict().values()))
    print(("ok   " if same else "FAIL ") + "load_state_dict(strict=True) of hddp's .pt")
    failures += not same
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
