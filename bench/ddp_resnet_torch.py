"""The peer: PyTorch's own DistributedDataParallel (Python, gloo) on the same
CIFAR-style ResNet-18, synthetic data, batch and thread count as
bench/ddp_resnet_bench.cpp. Run under hddp-run or torchrun. One JSON line per rank."""
import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(True),
            nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width))
        self.shortcut = None
        if stride != 1 or cin != width:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, width, 1, stride, 0, bias=False), nn.BatchNorm2d(width))

    def forward(self, x):
        return F.relu(self.body(x) + (self.shortcut(x) if self.shortcut is not None else x))


class ResNet18(nn.Module):
    """ResNet-18 with the CIFAR stem, as models/resnet.cpp builds it."""

    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(True))
        layers, cin = [], 64
        for i, width in enumerate((64, 128, 256, 512)):
            blocks = []
            for b in range(2):
                blocks.append(Block(cin, width, 2 if (b == 0 and i > 0) else 1))
                cin = width
            layers.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ddp", "plain"], default="ddp")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = ResNet18()
    rank, world = int(os.environ.get("RANK", 0)), 1
    if a.mode == "ddp":
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(a.batch, 3, 32, 32)
    y = torch.randint(0, 10, (a.batch,))
    for s in range(a.warmup + a.steps):
        if s == a.warmup:
            t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    seconds = time.perf_counter() - t0
    print(json.dumps({"impl": "torch", "mode": a.mode, "rank": rank, "world": world, "batch": a.batch,
                      "steps": a.steps, "seconds": seconds, "images_per_s": a.batch * a.steps / seconds}), flush=True)


if __name__ == "__main__":
    main()
