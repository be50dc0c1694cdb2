"""PyTorch's own powerSGD_hook on known inputs, for tests/ddp/power_sgd_test.cpp.

Runs the hook of the torch wheel (torch.distributed.algorithms.ddp_comm_hooks.
powerSGD_hook) on 2 ranks (Gloo, loopback) for several steps with error feedback and
warm start, on gradients drawn here, and writes the inputs, the starting Q and every
output to OUT_DIR/reference.json (the index) and OUT_DIR/reference.bin (float32 data),
so the C++ hook can be fed the same and compared.

usage: python power_sgd_reference.py OUT_DIR PORT
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

WORLD = 2
STEPS = 6  # 2 plain (start_powerSGD_iter = 2), then 4 compressed
# Two buckets; the second repeats a shape apart, to check PyTorch's order of the
# factors (grouped by shape, groups in order of first appearance).
BUCKETS = [
    [(16, 8), (8,), (6, 3, 2, 2)],
    [(5, 4), (16, 8), (7,), (5, 4), (12, 9)],
]
CONFIGS = [
    {"name": "rank1", "rank": 1, "min_rate": 2.0},
    {"name": "rank3", "rank": 3, "min_rate": 0.5},  # QR orthogonalisation, more compressed
]


class FakeBucket:
    """What powerSGD_hook asks of a dist.GradBucket."""

    def __init__(self, index, last, buffer, shapes):
        self._index, self._last, self._buffer, self._shapes = index, last, buffer, shapes

    def index(self):
        return self._index

    def is_last(self):
        return self._last

    def buffer(self):
        return self._buffer

    def gradients(self):
        out, at = [], 0
        for s in self._shapes:
            n = 1
            for d in s:
                n *= d
            out.append(self._buffer[at : at + n].view(s))
            at += n
        return out


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def factor_lengths(shapes, rank, min_rate):
    """The lengths of the P and Q memories of a bucket (the compressed tensors' factors)."""
    p_total, q_total = 0, 0
    for s in shapes:
        rows, cols = s[0], numel(s) // s[0]
        r = min(rows, cols, rank)
        if (rows + cols) * r * min_rate < rows * cols:
            p_total += rows * r
            q_total += cols * r
    return p_total, q_total


def inputs(config_index, step, rank, bucket):
    g = torch.Generator().manual_seed(1000 * config_index + 100 * step + 10 * rank + bucket)
    return torch.randn(sum(numel(s) for s in BUCKETS[bucket]), generator=g)


def first_q(config_index, bucket, length):
    g = torch.Generator().manual_seed(77 + 1000 * config_index + bucket)
    return torch.randn(length, generator=g)


def run(rank, out_dir, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {}
    for ci, c in enumerate(CONFIGS):
        state = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=c["rank"],
            start_powerSGD_iter=2,
            min_compression_rate=c["min_rate"],
            use_error_feedback=True,
            warm_start=True,
        )
        for step in range(STEPS):
            if step == 2:  # the starting Q, the same on every rank, instead of a random one
                for b, shapes in enumerate(BUCKETS):
                    p_len, q_len = factor_lengths(shapes, c["rank"], c["min_rate"])
                    state.p_memory_dict[b] = torch.empty(p_len)
                    state.q_memory_dict[b] = first_q(ci, b, q_len)
            for b, shapes in enumerate(BUCKETS):
                buffer = inputs(ci, step, rank, b).clone()
                bucket = FakeBucket(b, b == len(BUCKETS) - 1, buffer, shapes)
                out = psgd.powerSGD_hook(state, bucket).wait()
                results[f"{c['name']}.step{step}.rank{rank}.bucket{b}"] = out.clone()
    dist.barrier()
    dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def main():
    out_dir, port = sys.argv[1], int(sys.argv[2])
    mp.spawn(run, args=(out_dir, port), nprocs=WORLD, join=True)
    index, blob = {"world": WORLD, "steps": STEPS, "start": 2, "buckets": BUCKETS,
                   "configs": CONFIGS, "tensors": {}}, bytearray()

    def put(name, t):
        t = t.detach().to(torch.float32).contiguous()
        index["tensors"][name] = {"offset": len(blob) // 4, "numel": t.numel()}
        blob.extend(t.numpy().tobytes())

    for rank in range(WORLD):
        for name, t in torch.load(os.path.join(out_dir, f"rank{rank}.pt")).items():
            put("out." + name, t)
    for ci, c in enumerate(CONFIGS):
        for b, shapes in enumerate(BUCKETS):
            put(f"q0.{c['name']}.bucket{b}", first_q(ci, b, factor_lengths(shapes, c["rank"], c["min_rate"])[1]))
            for step in range(STEPS):
                for rank in range(WORLD):
                    put(f"in.{c['name']}.step{step}.rank{rank}.bucket{b}", inputs(ci, step, rank, b))
    with open(os.path.join(out_dir, "reference.bin"), "wb") as f:
        f.write(bytes(blob))
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(index, f)


if __name__ == "__main__":
    main()
