"""The peer: PyTorch's own torch.distributed Gloo allreduce, measured exactly as
bench/allreduce_bench.cpp measures hddp's. Run under hddp-run or torchrun."""
import argparse
import json
import time

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--min-bytes", type=int, default=4096)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--seconds", type=float, default=0.5)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    rank = dist.get_rank()
    nbytes = a.min_bytes
    while nbytes <= a.max_bytes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        for _ in range(a.warmup):
            dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        probe = time.perf_counter() - t0
        iters = torch.tensor([int(min(max(a.seconds / max(probe, 1e-6), 5.0), 5000.0))])
        dist.broadcast(iters, 0)
        count = int(iters.item())
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(count):
            dist.all_reduce(t)
        seconds = (time.perf_counter() - t0) / count
        bus = nbytes * 2.0 * (n - 1) / n / seconds / 1e9 if n > 1 else nbytes / seconds / 1e9
        if rank == 0:
            print(json.dumps({"impl": "torch", "world": n, "bytes": nbytes, "iters": count,
                              "seconds": seconds, "bus_GBps": bus}), flush=True)
        nbytes *= 4
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
