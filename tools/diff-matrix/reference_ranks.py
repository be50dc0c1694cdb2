"""The reference's per-rank backward: each rank's gradients as hddp's rank r holds them
before the reduction, and their sum as hddp's collective rounds it.

Where a reduction rounds (float16/bfloat16 compression of the buckets; float32 under
bf16 autocast), the whole-batch gradient of reference.py is not what hddp computes: the
rounding happens on each rank's part and on the partial sums. So for those cases the
reference trains like each rank, with hddp's arithmetic at the same points:

- each rank's forward and backward on its rows of each micro-step, the loss the mean
  over them (as bench/diff_matrix.cpp), under bf16 autocast where drawn;
- every incoming gradient multiplied by b_r / B by a tensor hook on the parameter, as
  DistributedDataParallel's pre-hook does (zeros for a zero share), accumulated over
  the micro-steps;
- per bucket of hddp's layout (the last bucket with its one status element, zero), the
  rank's buffer cast to the wire type (Tensor.to, as compressedAllreduceHook), summed in
  that type in Gloo's ring order, cast back (src/ddp/comm_hooks.cpp).

Gloo's ring allreduce (gloo/allreduce.cc, which c10d's ProcessGroupGloo runs for a CPU
tensor) cuts a buffer of `total` bytes into numSegments = roundUp(max(ceil(total / 1 MiB),
2W), W) segments of roundUp(ceil(total / numSegments), element size) bytes, W consecutive
groups of them (chunks); chunk k travels the ring from rank k-1 down to rank k, each rank
adding its own value to what arrives: x_k + (x_{k+1} + (... + x_{k-1})). Each addition
rounds to the wire type (c10::Half and c10::BFloat16 add in float and round, as torch's
CPU add does). With 2 ranks the order does not matter; with 3 it does, and the layout of
the step (bucket membership, position) comes from hddp's out/layout.json.
"""
import contextlib

import torch
import torch.nn.functional as F

WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}
MAX_SEGMENT_BYTES = 1 << 20  # gloo::AllreduceOptions::kMaxSegmentSize


def needed(cfg):
    """Whether a case needs the per-rank reference (a reduction that rounds)."""
    kind = (cfg.get("compression") or {}).get("kind")
    return kind in WIRE or bool(cfg.get("autocast"))


def needs_layout(cfg):
    """Whether the per-rank reference needs hddp's layout (out/layout.json): a step on 3
    ranks (where a rounded sum's order depends on the bucket), or ZeRO's clipping under
    autocast (whose float32 norms are summed per shard)."""
    from cases import world_of  # noqa: PLC0415 (cases imports zoo, zoo nothing of ours)
    three = any(world_of(cfg, s) > 2 for s in range(len(cfg["splits"])))
    zero_clip = cfg.get("autocast") and cfg["zero"]["stage"] > 0 and cfg["clip"] is not None
    return needed(cfg) and (three or zero_clip)


def clip(cfg, model, layout_step):
    """Clipping as hddp's driver does it, in the same arithmetic (a float32 norm rounds
    by kernel): ZeRO 0, LibTorch's torch::nn::utils::clip_grad_norm_ (each gradient's norm,
    the norm of those, max_norm / (norm + 1e-6) clamped to 1 as a tensor, multiplied in);
    ZeRO 1/2, ShardedOptimizer::clipGradNorm (per shard the sum of each float32 norm
    squared in float64, summed over ranks, the coefficient in float64, applied below 1)."""
    max_norm = cfg["clip"]
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return
    with torch.no_grad():
        norm = torch.ops.aten.norm.Scalar  # C++'s Tensor::norm; Python's goes to linalg
        if cfg["zero"]["stage"] == 0:
            norms = [norm(p.grad, 2) for p in params]
            total = norms[0] if len(norms) == 1 else norm(torch.stack(norms), 2)
            # C++'s double / Tensor is empty_like(t).fill_(x).div_(t) (ATen's
            # TensorOperators.h), Python's t.reciprocal() * x: they round differently.
            shifted = total + 1e-6
            coefficient = torch.clamp(torch.empty_like(shifted).fill_(max_norm).div_(shifted), max=1.0)
            for p in params:
                p.grad.mul_(coefficient)
            return
        named = dict(model.named_parameters())
        squares = 0.0
        for shard in layout_step["shards"]:
            part = torch.zeros(1, dtype=torch.float64)
            for name in shard:
                if named[name].grad is not None:
                    part += norm(named[name].grad, 2).double().pow(2)
            squares += part.item()
        coefficient = max_norm / (squares ** 0.5 + 1e-6)
        if coefficient < 1.0:
            for p in params:
                p.grad.mul_(coefficient)


def _loss(cfg, out, y):
    return F.cross_entropy(out, y) if cfg["loss"] == "ce" else F.mse_loss(out, y)


def rank_gradients(cfg, model, tensors, s, scaler):
    """Per rank of step `s`: {name: its weighted gradient, or None where the rank did not
    use the parameter}, after its micro-steps' backward passes."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    step = cfg["splits"][s]
    world, total = len(step[0]), sum(sum(c) for c in step)
    weight = [1.0]

    def weigh(g):  # DistributedDataParallel::Impl::registerHook's pre-hook
        if weight[0] == 0.0:
            return torch.zeros_like(g)
        return g if weight[0] == 1.0 else g * weight[0]

    hooks = [p.register_hook(weigh) for p in params.values()]
    # Without autocast's weight cache, as bench/diff_matrix (its ranks are threads of one
    # process, where the cache mixes them up): a weight used twice (tied) is then cast
    # twice, and its two bf16 gradients are summed in float32, not in bf16.
    amp = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False) if cfg.get("autocast") else None
    grads = []
    try:
        for r in range(world):
            for p in params.values():
                p.grad = None
            for m, counts in enumerate(step):
                local = counts[r]
                if local == 0 and not cfg["empty_forward"]:
                    continue
                begin = sum(counts[:r])
                x = tensors[f"x/{s}/{m}"][begin:begin + local]
                y = tensors[f"y/{s}/{m}"][begin:begin + local]
                mask = None
                if cfg["heads"] is not None:
                    use = local > 0 and cfg["heads"][s][m][r]
                    mask = torch.full((local,), bool(use), dtype=torch.bool)
                weight[0] = local / total
                with amp if amp is not None else contextlib.nullcontext():
                    loss = _loss(cfg, model(x, mask), y)
                (scaler.scale(loss) if scaler else loss).backward()
            grads.append({n: None if p.grad is None else p.grad.detach().clone()
                          for n, p in params.items()})
    finally:
        for h in hooks:
            h.remove()
    return grads


def ring_sum(parts, dtype):
    """Gloo's ring allreduce of `parts` (one flat tensor per rank, already of `dtype`),
    summed in `dtype` in the ring's order (see the top of this file)."""
    world = len(parts)
    if world == 1:
        return parts[0].clone()
    n = parts[0].numel()
    size = parts[0].element_size()
    total = n * size
    segments = max(-(-total // MAX_SEGMENT_BYTES), 2 * world)
    segments = -(-segments // world) * world
    per_rank = segments // world
    segment_bytes = -(-(-(-total // segments)) // size) * size
    chunk = (torch.arange(n) * size // segment_bytes) // per_rank
    out = torch.empty_like(parts[0])
    for k in range(world):
        at = chunk == k
        acc = parts[(k - 1) % world][at]
        for j in range(2, world + 1):
            acc = parts[(k - j) % world][at] + acc
        out[at] = acc
    return out


def reduce_gradients(cfg, grads, layout_step, params, has_status):
    """The sum over ranks of `grads` (rank_gradients) as hddp's reduction rounds it: per
    bucket of `layout_step` (hddp's; None: one bucket in parameter order, where the order
    does not matter), cast to the wire type, ring-summed, cast back. Returns
    {name: summed gradient} for the parameters some rank used."""
    kind = (cfg.get("compression") or {}).get("kind")
    names = [n for n in params if any(g[n] is not None for g in grads)]
    buckets = [list(params)] if layout_step is None else layout_step["buckets"]
    summed = {}
    for b, bucket in enumerate(buckets):
        status = 1 if has_status and b + 1 == len(buckets) else 0
        parts = []
        for g in grads:
            flat = [(g[n] if g[n] is not None else torch.zeros_like(params[n])).reshape(-1)
                    for n in bucket]
            dtype = params[bucket[0]].dtype
            flat.append(torch.zeros(status, dtype=dtype))
            buffer = torch.cat(flat)
            parts.append(buffer.to(WIRE[kind]) if kind in WIRE else buffer)
        total = ring_sum(parts, parts[0].dtype).to(params[bucket[0]].dtype)
        at = 0
        for n in bucket:
            k = params[n].numel()
            summed[n] = total[at:at + k].view_as(params[n])
            at += k
    return {n: summed[n] for n in names}


def backward_of_step(cfg, model, tensors, s, scaler, layout_step):
    """Sets every parameter's .grad as hddp's ranks hold it after step `s`'s backward:
    the rounded sum of the ranks' weighted gradients for a parameter some rank used; a
    parameter no rank used keeps the .grad it had (findUnusedParameters)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.grad for n, p in params.items()}
    grads = rank_gradients(cfg, model, tensors, s, scaler)
    has_status = cfg["zero"]["stage"] == 0  # hddp's own hooks sum the status slot too
    if layout_step is not None:
        missing = set(params) - {n for bucket in layout_step["buckets"] for n in bucket}
        assert not missing, f"hddp's layout of step {s} lacks {sorted(missing)}"
    summed = reduce_gradients(cfg, grads, layout_step, params, has_status)
    for n, p in params.items():
        p.grad = summed[n].clone() if n in summed else before[n]
