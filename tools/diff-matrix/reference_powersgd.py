"""The reference of the PowerSGD cases: PyTorch's own DDP with PyTorch's own
`powerSGD_hook` (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py), on
`world` processes over Gloo on loopback, in float64, with equal shares.

hddp's hook (src/ddp/power_sgd.cpp) follows powerSGD_hook with two differences that
equal shares and this module make vanish:
- hddp hands the hook gradients weighted by b_r / B and sums; torch's DDP hands it each
  rank's mean gradient and the hook divides by the world size. With equal shares the
  results are equal up to float64 rounding (the orthogonalisation normalises P, so the
  1/W moves through the arithmetic unchanged; the error memories differ by the factor
  W, in the same way).
- The random starting Q: both seed the CPU generator with a number below 10^9 and draw
  torch.randn in the same order (shape groups in bucket order), but torch takes the
  numbers from numpy's RandomState(random_seed).randint and hddp from
  std::mt19937_64(randomSeed), one per drawing bucket that has a matrix to compress.
  `HddpSeeds` below gives torch's hook hddp's numbers (an mt19937_64 in Python), so
  that everything else that is compared is torch's code. torch draws a number for a
  bucket with nothing to compress too (and discards it); HddpSeeds skips those, as
  hddp does not draw for them.
- P and Q travel in the gradients' type (float64) in both by default. A case with
  "wire": "float32" has hddp cast them for their allreduces (PowerSgdOptions::wireType
  = at::kFloat), and `Float32Wire` does the same to torch's, so that with 1 or 2 ranks
  the results agree to float64 rounding (x/2 rounds as x does); with 3 the float32 sums
  of g_r/3 (hddp) and g_r (torch) round differently, and matrix.py's RTOL_POWERSGD
  applies.

Processes: one torch.multiprocessing spawn per world size, each rank training every
case of that size in turn and rank 0 writing `reference_powersgd.safetensors` (or
`reference_powersgd.txt`, the error) into the case folder; bounded by a timeout.
"""
import contextlib
import datetime
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

RESULT = "reference_powersgd.safetensors"
ERROR = "reference_powersgd.txt"
_MASK = (1 << 64) - 1


class Mt19937_64:
    """std::mt19937_64 (the C++ standard's parameters): what hddp seeds Q's generator from."""

    def __init__(self, seed):
        self.mt = [seed & _MASK]
        for i in range(1, 312):
            prev = self.mt[-1]
            self.mt.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & _MASK)
        self.index = 312

    def __call__(self):
        if self.index >= 312:
            for i in range(312):
                x = (self.mt[i] & ~((1 << 31) - 1) & _MASK) | (self.mt[(i + 1) % 312] & ((1 << 31) - 1))
                self.mt[i] = self.mt[(i + 156) % 312] ^ (x >> 1) ^ (0xB5026F5AA96619E9 if x & 1 else 0)
            self.index = 0
        y = self.mt[self.index]
        self.index += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & _MASK


class HddpSeeds:
    """Stands in for PowerSGDState.rng: randint(high) gives hddp's next seed
    (mt19937_64() % 10^9) for a bucket with a matrix to compress, and 0 (unused by
    torch, and not a draw of hddp's) for one without."""

    def __init__(self, seed):
        self.engine = Mt19937_64(seed)
        self.bucket_has_matrices = True

    def randint(self, high):
        return self.engine() % high if self.bucket_has_matrices else 0


class _Done:
    """A finished collective, as dist.all_reduce(..., async_op=True) returns one."""

    def __init__(self, tensor):
        self.future = torch.futures.Future()
        self.future.set_result([tensor])

    def get_future(self):
        return self.future

    def wait(self):
        return True


class Float32Wire:
    """torch.distributed as powerSGD_hook sees it, but with P's and Q's allreduces in
    float32, as hddp sends them with PowerSgdOptions::wireType = at::kFloat (the float64
    factors are cast, summed in float32 and cast back). Every other call is
    torch.distributed's."""

    def __init__(self, state):
        self.state = state

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, tensor, group=None, async_op=False):
        factors = list(self.state.p_memory_dict.values()) + list(self.state.q_memory_dict.values())
        if tensor.dtype != torch.float64 or not any(tensor is f for f in factors):
            return dist.all_reduce(tensor, group=group, async_op=async_op)
        wire = tensor.float()
        dist.all_reduce(wire, group=group)
        tensor.copy_(wire)
        return _Done(tensor)


def _hook(state, bucket):
    """torch's powerSGD_hook, told first whether the bucket has a matrix to compress."""
    has = False
    for t in bucket.gradients():
        n, m = t.shape[0], t.numel() // max(t.shape[0], 1)
        rank = min(n, m, state.matrix_approximation_rank)
        has = has or psgd._should_compress(n, m, rank, state.min_compression_rate)[0]
    state.rng.bucket_has_matrices = has
    return psgd.powerSGD_hook(state, bucket)


def _train(cfg, tensors, rank, world, lr_scale):
    import reference  # noqa: PLC0415 (spawned processes import it here)
    import zoo  # noqa: PLC0415

    model = zoo.make(cfg, cfg["seed"])
    model.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("init/")})
    if cfg.get("frozen"):
        model.get_parameter(cfg["frozen"]).requires_grad_(False)
    if cfg["broadcast"] and rank != 0:  # DDP's broadcast at construction replaces them
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                t.fill_(0.25)
    model.train()
    d, c = cfg["ddp"], cfg["compression"]
    # Without find_unused_parameters whatever hddp's setting (mlp and tied use every
    # parameter): torch's DDP then sends its used-parameter map while the hook's P and Q
    # allreduces are launched from Gloo's callback threads, and the ranks' collectives
    # can pair the wrong way round (a size mismatch that aborts, seen with 3 ranks).
    ddp = DDP(model, gradient_as_bucket_view=d["gradient_as_bucket_view"])
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=c["rank"],
                               start_powerSGD_iter=c["start"], min_compression_rate=2,
                               use_error_feedback=c["error_feedback"], warm_start=c["warm_start"],
                               orthogonalization_epsilon=0, random_seed=0)
    state.rng = HddpSeeds(c["seed"])
    # P and Q in the gradients' type (torch's and hddp's default), or in float32 where the
    # case has hddp send them so.
    psgd.dist = Float32Wire(state) if c.get("wire") == "float32" else dist
    ddp.register_comm_hook(state, _hook)
    opt = reference.make_optimizer(dict(cfg["optimizer"], lr=cfg["optimizer"]["lr"] * lr_scale), model)
    for s, step in enumerate(cfg["splits"]):
        opt.zero_grad(set_to_none=cfg["zero_grad_to_none"])
        for m, counts in enumerate(step):
            assert len(set(counts)) == 1 and len(counts) == world, "PowerSGD cases have equal shares"
            begin, local = sum(counts[:rank]), counts[rank]
            x = tensors[f"x/{s}/{m}"][begin:begin + local]
            y = tensors[f"y/{s}/{m}"][begin:begin + local]
            with ddp.no_sync() if m + 1 < len(step) else contextlib.nullcontext():
                out = ddp(x)
                loss = torch.nn.functional.cross_entropy(out, y) if cfg["loss"] == "ce" else \
                    torch.nn.functional.mse_loss(out, y)
                (loss / len(step)).backward()  # hddp weighs b / B over all micro-steps
        if cfg["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        if cfg.get("lr_decay"):
            for group in opt.param_groups:
                group["lr"] *= cfg["lr_decay"]
    return reference.final_state(model, opt)


def _worker(rank, world, address, folders, timeout_s, lr_scale):
    torch.set_num_threads(1)
    if not os.environ.get("DIFF_MATRIX_TORCH_OUTPUT"):  # torch's DDP warns; errors go to ERROR
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    for folder in folders:
        with open(os.path.join(folder, "case.json")) as f:
            cfg = json.load(f)
        try:
            result = _train(cfg, load_file(os.path.join(folder, "data.safetensors")), rank, world,
                            lr_scale)
            if rank == 0:
                save_file({k: v.contiguous() for k, v in result.items()}, os.path.join(folder, RESULT))
        except Exception as e:  # noqa: BLE001 (reported as the case's reference error)
            with open(os.path.join(folder, ERROR), "a") as f:
                f.write(f"rank {rank}: {type(e).__name__}: {e}\n")
            raise
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cases, lr_scale=1.0):
    """Trains `cases` ([(cfg, folder)]) under torch's DDP: one group of processes per
    world size, at most 60 s + 5 s per case each. Returns {folder: result dict or an
    error string}. `lr_scale` plants a wrong learning rate, as reference.train's."""
    by_world = {}
    for cfg, folder in cases:
        for name in (RESULT, ERROR):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))
        by_world.setdefault(cfg["world"], []).append(folder)
    for world, folders in sorted(by_world.items()):
        address = f"tcp://127.0.0.1:{_free_port()}"
        timeout_s = 60 + 5 * len(folders)
        ctx = mp.start_processes(_worker, args=(world, address, folders, 60, lr_scale),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.time() + timeout_s
        try:
            while not ctx.join(timeout=1):
                if time.time() > deadline:
                    raise TimeoutError(f"torch's DDP ({world} processes) ran past {timeout_s} s")
        except Exception as e:  # noqa: BLE001 (a rank died or the group hung: say so per case)
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for folder in folders:
                if not os.path.exists(os.path.join(folder, RESULT)):
                    with open(os.path.join(folder, ERROR), "a") as f:
                        f.write(f"{type(e).__name__}: {str(e)[-400:]}\n")
    results = {}
    for _, folder in cases:
        path = os.path.join(folder, RESULT)
        if os.path.exists(path):
            results[folder] = load_file(path)
        else:
            with open(os.path.join(folder, ERROR)) as f:
                results[folder] = "torch's DDP: " + f.read().strip()
    return results
