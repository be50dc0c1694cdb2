#!/usr/bin/env python3
"""torchvision's ResNet-18 into train_resnet on small images (#52 item 5), both ways:

1. torchvision.models.resnet18(num_classes=10) as Python builds it (7x7/2 conv1 and a
   max-pool) fails --init-from on 32 px images (the CIFAR stem), and the error names
   the two lines of Python and --stem torchvision;
2. with --stem torchvision it loads, and --export's file loads back into torchvision's
   model with strict=True, holding the weights it started from (a learning rate of ~0);
3. the two lines of Python from the error, applied to torchvision's model, give a
   state dict that loads into the trainer's default (CIFAR) stem, and its export loads
   back into that changed model with strict=True.
"""
import argparse
import subprocess
import sys
import tempfile

import torch
import torchvision

failures = 0


def check(ok, what):
    global failures
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    failures += not ok


def train(args, flags):
    cmd = [args.train_resnet, "--model", "resnet18", "--dataset", "synthetic", "--image-size",
           "32", "--channels", "3", "--global-batch", "8", "--limit-train", "16",
           "--limit-test", "8", "--workers", "0", "--threads", "1", "--progress", "off",
           "--no-augment", "--max-steps", "1", "--lr", "1e-12", "--weight-decay", "0",
           "--momentum", "0", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def same_weights(exported, original):
    keys = [k for k in original if "running" not in k and "num_batches" not in k]
    return all(torch.allclose(exported[k], original[k], atol=1e-7) for k in keys)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-resnet", required=True)
    args = ap.parse_args()
    d = tempfile.mkdtemp()
    torch.manual_seed(0)
    tv = torchvision.models.resnet18(num_classes=10)
    torch.save(tv.state_dict(), f"{d}/tv.pt")

    # 1. The CIFAR stem refuses it and says what to do.
    r = train(args, ["--init-from", f"{d}/tv.pt"])
    fix = ("model.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False); "
           "model.maxpool = torch.nn.Identity()")
    check(r.returncode == 2 and fix in r.stderr and "--stem torchvision" in r.stderr
          and "hddp: hddp:" not in r.stderr and ".cpp:" not in r.stderr,
          "the CIFAR stem refuses torchvision's conv1 and the error says the fix")
    if fix not in r.stderr:
        print(r.stderr[-3000:])

    # 2. --stem torchvision: in and back out.
    r = train(args, ["--stem", "torchvision", "--init-from", f"{d}/tv.pt", "--export",
                     f"{d}/back.pt"])
    if r.returncode != 0:
        print(r.stderr[-3000:])
    check(r.returncode == 0, "--stem torchvision loads torchvision's resnet18")
    if r.returncode == 0:
        back = torch.load(f"{d}/back.pt", weights_only=True)
        model = torchvision.models.resnet18(num_classes=10)
        model.load_state_dict(back, strict=True)
        check(same_weights(back, tv.state_dict()),
              "its export loads into torchvision with strict=True, the same weights")

    # 3. The two lines of Python from the error message.
    cifar = torchvision.models.resnet18(num_classes=10)
    exec(fix, {"torch": torch, "model": cifar})
    torch.save(cifar.state_dict(), f"{d}/cifar.pt")
    r = train(args, ["--init-from", f"{d}/cifar.pt", "--export", f"{d}/cifar_back.pt"])
    if r.returncode != 0:
        print(r.stderr[-3000:])
    check(r.returncode == 0, "the Python fix's model loads into the default stem")
    if r.returncode == 0:
        back = torch.load(f"{d}/cifar_back.pt", weights_only=True)
        cifar.load_state_dict(back, strict=True)
        check(same_weights(back, torch.load(f"{d}/cifar.pt", weights_only=True)),
              "its export loads back into the changed torchvision model, the same weights")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
