#!/usr/bin/env python3
"""hddp's ResNet-18/34/50 and torchvision's, as a user takes a model across:

1. train_resnet trains ResNet-18 (ImageNet stem) on 2 ranks for a few steps on
   synthetic data and exports it (--export hddp.pt); torchvision's resnet18 loads the
   file with load_state_dict(strict=True), and its eval-mode logits on a batch equal
   hddp's own forward of the same file (hddp_resnet_forward) to float tolerance;
2. the reverse, for resnet18, resnet34 and resnet50: torchvision models (with trained
   BatchNorm statistics) saved by torch.save load into hddp's ResNets with the same
   logits;
3. fine-tuning as a user starts it: a 1000-class torchvision model, saved by Python's
   safetensors, starts train_resnet --init-from with --init-skip fc. (10 classes) on 2
   ranks, and
   --export's .safetensors holds its weights (fc new) and loads into torchvision's
   model through Python's safetensors, again with hddp's logits.
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch
import torchvision
from safetensors.torch import load_file, save_file

failures = 0


def check(ok, what):
    global failures
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    failures += not ok


def run(cmd, timeout=300):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        print("command failed:", " ".join(cmd), "\n", r.stdout[-2000:], r.stderr[-4000:])
        sys.exit(1)
    return r


def hddp_logits(args, d, arch, classes, state, x):
    save_file({"input": x.contiguous()}, f"{d}/input.safetensors")
    run([args.forward, arch, str(classes), "224", state, f"{d}/input.safetensors",
         f"{d}/output.safetensors"])
    return load_file(f"{d}/output.safetensors")["output"]


def same_logits(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--forward", required=True)
    ap.add_argument("--train-resnet", required=True)
    ap.add_argument("--hddp-run", required=True)
    args = ap.parse_args()
    d = tempfile.mkdtemp()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    common = ["--model", "resnet18", "--dataset", "synthetic", "--image-size", "72",
              "--channels", "3", "--global-batch", "8", "--limit-train", "32", "--limit-test",
              "16", "--eval-batch", "16", "--workers", "0", "--threads", "1", "--progress",
              "off", "--no-augment"]
    x = torch.randn(3, 3, 72, 72)

    # 1. Trained by hddp on 2 ranks, loaded by torchvision.
    run([args.hddp_run, "--nproc-per-node", "2", "--", args.train_resnet, *common,
         "--max-steps", "3", "--export", f"{d}/hddp.pt"], timeout=400)
    sd = torch.load(f"{d}/hddp.pt", weights_only=True)
    tv = torchvision.models.resnet18(num_classes=10)
    tv.load_state_dict(sd, strict=True)
    check(sd["bn1.num_batches_tracked"].item() == 3 and sd["bn1.running_var"].ne(1).any().item(),
          f"hddp's export carries the trained BatchNorm statistics "
          f"(num_batches_tracked {sd['bn1.num_batches_tracked'].item()})")
    tv.eval()
    with torch.no_grad():
        want = tv(x)
    ok, diff = same_logits(hddp_logits(args, d, "resnet18", 10, f"{d}/hddp.pt", x), want)
    check(ok, f"hddp-trained resnet18 in torchvision: same logits (largest difference {diff:.2e})")

    # 2. torchvision's models into hddp's.
    for arch in ("resnet18", "resnet34", "resnet50"):
        m = getattr(torchvision.models, arch)(num_classes=10)
        m.train()
        with torch.no_grad():
            for _ in range(2):  # BatchNorm statistics that are not the initial ones
                m(torch.randn(4, 3, 64, 64) * 2 + 0.5)
        m.eval()
        torch.save(m.state_dict(), f"{d}/{arch}.pt")
        xs = torch.randn(2, 3, 64, 64)
        with torch.no_grad():
            want = m(xs)
        ok, diff = same_logits(hddp_logits(args, d, arch, 10, f"{d}/{arch}.pt", xs), want)
        check(ok, f"torchvision {arch} in hddp: same logits (largest difference {diff:.2e})")

    # 3. Fine-tuning from a 1000-class model through safetensors, with a new head.
    pre = torchvision.models.resnet18()  # 1000 classes, as ImageNet's weights
    save_file({k: v.contiguous() for k, v in pre.state_dict().items()}, f"{d}/pre.safetensors")
    # On 2 ranks: rank 0 reads the file, DDP gives rank 1 its weights.
    run([args.hddp_run, "--nproc-per-node", "2", "--", args.train_resnet, *common, "--max-steps",
         "1", "--lr", "1e-12", "--weight-decay", "0", "--momentum", "0", "--init-from",
         f"{d}/pre.safetensors", "--init-skip", "fc.", "--export", f"{d}/tuned.safetensors"],
        timeout=400)
    tuned = load_file(f"{d}/tuned.safetensors")
    pre_sd = pre.state_dict()
    kept = [k for k in pre_sd if not k.startswith("fc.") and "running" not in k
            and "num_batches" not in k]
    check(all(torch.allclose(tuned[k], pre_sd[k], atol=1e-7) for k in kept),
          f"--init-from loaded the {len(kept)} pretrained parameters")
    check(tuned["fc.weight"].shape == (10, 512), "--init-skip fc. left the 10-class head new")
    tv10 = torchvision.models.resnet18(num_classes=10)
    tv10.load_state_dict(tuned, strict=True)
    tv10.eval()
    with torch.no_grad():
        want = tv10(x)
    ok, diff = same_logits(hddp_logits(args, d, "resnet18", 10, f"{d}/tuned.safetensors", x), want)
    check(ok, f"safetensors round trip: same logits (largest difference {diff:.2e})")

    # A key prefix that matches nothing is an error on every rank, not a silent full load;
    # so is an --export whose folder does not exist, before any training.
    for flags, message in ((["--init-from", f"{d}/pre.safetensors", "--init-skip", "head."],
                            "--init-skip head. matches none of the model's keys"),
                           (["--export", f"{d}/missing/model.pt"], "create the folder")):
        r = subprocess.run([args.hddp_run, "--nproc-per-node", "2", "--no-prefix", "--",
                            args.train_resnet, *common, "--max-steps", "1", *flags],
                           capture_output=True, text=True, timeout=300)
        told = r.stderr.count(message)
        check(r.returncode != 0 and told >= 1 and "step 1" not in r.stderr,
              f"{flags[-2]} {flags[-1]}: an error before training "
              f"(exit {r.returncode}, told by {told} rank(s))")
        if told < 1:
            print(r.stderr[-3000:])
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
