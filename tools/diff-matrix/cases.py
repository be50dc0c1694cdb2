"""Seeded random configurations of the differential matrix, and their case folders.

A case folder holds what the C++ driver (bench/diff_matrix.cpp) reads:
- case.json: the configuration (see draw());
- data.safetensors: the initial state dict as `init/<name>`, and each micro-step's
  global micro-batch as `x/<step>/<micro>` (float64 [n, in]) and `y/<step>/<micro>`
  (int64 [n] classes for "ce", float64 [n, out] for "mse"); float32 where the case has
  "autocast". Rank r's samples of a micro-step are the rows after those of ranks
  0..r-1 (splits[step][micro]; after a "resume" at step k, the steps from k on are split
  over the second world size).
The driver writes out/ (its ranks' results, the bucket layout of each step) and, for a
resume, state/ (what it saved); reference_powersgd.py writes reference_powersgd.*.
"""
import copy
import json
import os
import random

import torch
from safetensors.torch import save_file

import zoo

OPTIMIZERS = ("sgd", "adam", "adamw")


def _split(rng, n, world, at_least):
    """n samples over `world` ranks at random, each rank >= at_least (zeros allowed at 0)."""
    counts = [at_least] * world
    for _ in range(n - at_least * world):
        counts[rng.randrange(world)] += 1
    if at_least == 0 and rng.random() < 0.3:
        # Lopsided on purpose: one rank takes everything, or one rank gets nothing.
        if rng.random() < 0.5:
            counts = [0] * world
            counts[rng.randrange(world)] = n
        elif world > 1:
            z = rng.randrange(world)
            moved, counts[z] = counts[z], 0
            counts[(z + 1) % world] += moved
    return counts


def _optimizer(rng, kind=None):
    kind = kind or rng.choice(OPTIMIZERS)
    if kind == "sgd":
        momentum = rng.choice([0.0, 0.9, round(rng.uniform(0.1, 0.95), 3)])
        dampening = rng.choice([0.0, 0.0, 0.3]) if momentum > 0 else 0.0
        return {"kind": kind, "lr": round(rng.uniform(0.01, 0.3), 4), "momentum": momentum,
                "dampening": dampening,
                "nesterov": bool(momentum > 0 and dampening == 0 and rng.random() < 0.5),
                "weight_decay": rng.choice([0.0, 1e-3, 0.05])}
    return {"kind": kind, "lr": round(rng.uniform(1e-3, 0.05), 5),
            "betas": rng.choice([[0.9, 0.999], [0.8, 0.99], [0.5, 0.9]]),
            "eps": rng.choice([1e-8, 1e-6]),
            "weight_decay": rng.choice([0.0, 1e-2, 0.1]),
            "amsgrad": rng.random() < 0.3}


def _step(rng, norm, world, micro, equal_share=0):
    """One optimizer step's split ([micro][world] sample counts) and which ranks use the
    head in each micro-step. `equal_share` > 0: every rank gets that many samples."""
    step_split, step_heads = [], []
    only = rng.randrange(world)  # "bn": the rank that trains this whole step
    for _ in range(micro):
        if equal_share:
            counts = [equal_share] * world
        elif norm == "syncbn":  # every rank needs a sample; BatchNorm needs two
            n = rng.randint(max(2, world), 10)
            counts = _split(rng, n, world, 1)
        elif norm == "bn":  # per-rank statistics are exact when one rank trains
            n = rng.randint(2, 10)
            counts = [n if r == only else 0 for r in range(world)]
        else:
            n = rng.randint(1, 10)
            counts = _split(rng, n, world, 0)
        step_split.append(counts)
        step_heads.append([rng.random() < 0.4 for _ in range(world)])
    return step_split, step_heads


def _compression(rng, kind):
    """DdpOptions::compression: "fp16", "bf16", or "powersgd" with PowerSgdOptions. (A
    pinned "wire": "float32" sends P and Q in float32: PowerSgdOptions::wireType.)"""
    if kind != "powersgd":
        return {"kind": kind}
    return {"kind": kind, "rank": rng.choice([1, 1, 2, 3]), "start": rng.choice([2, 2, 3]),
            "error_feedback": rng.random() < 0.8, "warm_start": rng.random() < 0.7,
            "seed": rng.randrange(1 << 32)}


def _weights(rng, world):
    """ZeRO shard weights: a rank without a shard included, never all zero."""
    weights = [rng.choice([0.0, 1.0, 2.0, 3.0, round(rng.uniform(0.1, 4), 2)]) for _ in range(world)]
    if sum(weights) == 0:
        weights[rng.randrange(world)] = 1.0
    return weights


def _settle(cfg, rng, pinned):
    """Fits the axes of version 2 to the rest of the configuration: adjusts what they
    need of keys that were drawn, or drops a drawn axis that cannot apply (a pinned one
    that cannot is an error). docs/reliability.md says why each rule is there."""
    parts, norm = zoo.parts(cfg["model"]), zoo.norm(cfg["model"])

    def drop(key, why):
        assert key not in pinned, f"{key} is pinned, but {why}"
        cfg[key] = False if key == "autocast" else None

    def needs(key, value, why):
        assert key not in pinned or cfg[key] == value, f"{key} is pinned, but {why}"
        cfg[key] = value

    c = cfg["compression"]
    kind = c["kind"] if c else None
    zero_pinned = "zero" in pinned and cfg["zero"]["stage"] > 0
    if kind in ("fp16", "bf16"):
        if norm == "syncbn" or zero_pinned:  # (a rank's share of a gradient through global
            # statistics has no per-rank reference; ZeRO reduces to owners, refusing hooks)
            drop("compression", "SyncBatchNorm and ZeRO 1/2 do not combine with it here")
        else:
            cfg["zero"]["stage"] = 0  # ZeRO reduces to owners and refuses a hook
    elif kind == "powersgd":
        unequal = "splits" in pinned and any(len(set(c)) > 1 for st in cfg["splits"] for c in st)
        if parts - {"tied"} or unequal or zero_pinned or \
                cfg["scaler"] is not None and "scaler" in pinned:
            drop("compression", "PowerSGD is compared with torch's DDP: equal shares, mlp or tied")
        else:
            _settle_powersgd(cfg, rng, pinned)
    if cfg["autocast"]:
        if norm == "syncbn" or kind == "powersgd":
            drop("autocast", "autocast has a per-rank reference only (no SyncBatchNorm, no PowerSGD)")
        else:
            if cfg["optimizer"]["kind"] != "sgd":  # Adam turns bf16 noise into +-lr steps
                cfg["optimizer"] = dict(_optimizer(rng, "sgd"),
                                        second_group=cfg["optimizer"].get("second_group"))
            needs("scaler", None, "bf16 autocast needs no GradScaler")
    if cfg["resume"] is not None:
        if cfg["steps"] < 2:
            drop("resume", "a resume needs a step on each side")
        elif "splits" in pinned:  # a regression: the pins say it all
            assert {"at", "world", "weights"} <= set(cfg["resume"]), "pin all of resume with splits"
        else:
            _settle_resume(cfg, rng, parts, norm)


def _settle_powersgd(cfg, rng, pinned):
    """PowerSGD is compared with PyTorch's powerSGD_hook under torch's DDP: equal shares,
    one bucket, no GradScaler, matrices large enough for a rank of 2 or 3 to compress,
    and at least rank + 2 samples per step (a gradient of lower rank than the
    approximation leaves P columns of rounding noise, which no two implementations share)."""
    c = cfg["compression"]
    world, micro = cfg["world"], cfg["micro"]
    if "dims" not in pinned:  # rank 3 compresses fc1 or enc from 13 hidden units on
        cfg["dims"] = {"in": rng.randint(3, 10), "hidden": rng.randint(13 if c["rank"] == 3 else 6, 16),
                       "out": rng.randint(2, 4)}
    if "steps" not in pinned:
        cfg["steps"] = max(cfg["steps"], c["start"] + rng.randint(1, 2))
    share = max(rng.randint(1, 3), -(-(c["rank"] + 2) // (world * micro)))
    if "splits" not in pinned:
        cfg["splits"] = [_step(rng, None, world, micro, equal_share=share)[0]
                         for _ in range(cfg["steps"])]
    cfg["heads"] = None
    cfg["zero"]["stage"] = 0
    cfg["scaler"] = None
    cfg["empty_forward"] = False
    cfg["ddp"].update(first_bucket_bytes=1 << 20, bucket_cap_bytes=25 << 20, rebuild_buckets=True)


def _settle_resume(cfg, rng, parts, norm):
    """Save after step `at` on N ranks, resume on M: the steps from `at` on are split
    over M ranks (PowerSGD: M = N, its error memories are per rank)."""
    r = cfg["resume"]
    steps, micro = cfg["steps"], cfg["micro"]
    r.setdefault("at", rng.randint(1, steps - 1))
    powersgd = (cfg["compression"] or {}).get("kind") == "powersgd"
    r.setdefault("world", cfg["world"] if powersgd else rng.randint(1, 3))
    r.setdefault("weights", _weights(rng, r["world"]))
    share = cfg["splits"][0][0][0] if powersgd else 0
    for s in range(r["at"], steps):
        split, heads = _step(rng, norm, r["world"], micro, equal_share=share)
        cfg["splits"][s] = split
        if cfg["heads"] is not None:
            cfg["heads"][s] = heads
    sc = cfg["scaler"]
    if sc is not None and sc["overflow_step"] is not None and sc["overflow_step"] >= r["at"]:
        sc["overflow_rank"] = rng.randrange(r["world"])
    if "unused" in parts:
        # .grad is not part of any state file: a resumed run starts without gradients, so
        # a head unused after the resume would stay zero (and decay) in a straight run only.
        cfg["zero_grad_to_none"] = True


def compresses(cfg):
    """Whether PowerSGD compresses some gradient of the case's model: a matrix n x m with
    (n + m) x min(n, m, rank) x 2 < n x m (powerSGD_hook's _should_compress, rate 2)."""
    d, rank = cfg["dims"], cfg["compression"]["rank"]
    shapes = [(d["hidden"], d["in"]), (d["out"], d["hidden"])]
    if "tied" in zoo.parts(cfg["model"]):
        shapes.append((d["hidden"], d["hidden"]))
    return any((n + m) * min(n, m, rank) * 2 < n * m for n, m in shapes)


def world_of(cfg, s):
    """The number of ranks that train step `s`."""
    r = cfg.get("resume")
    return r["world"] if r and s >= r["at"] else cfg["world"]


def final_world(cfg):
    """The number of ranks that write a result: the last step's."""
    return world_of(cfg, len(cfg["splits"]) - 1)


def draw(seed, **fixed):
    """The configuration of `seed`. `fixed` pins keys: world, model, micro and steps
    before the splits are drawn; any other top-level key replaces the drawn value (a
    dict merges into it: optimizer={"kind": "adam"}, zero={"stage": 2}, ddp={...})."""
    rng = random.Random(seed)
    world = fixed.get("world", rng.randint(1, 3))
    model = fixed.get("model", rng.choice(zoo.KINDS))
    if "model" not in fixed and rng.random() < 0.3:  # a combination of parts
        picked = [rng.choice(["bn", "syncbn", None]), rng.choice(["tied", None]),
                  rng.choice(["unused", None])]
        model = "+".join(p for p in picked if p) or "mlp"
    norm = zoo.norm(model)
    micro = fixed.get("micro", rng.choice([1, 1, 2, 3]))
    steps = fixed.get("steps", rng.randint(2, 4))
    dims = {"in": rng.randint(2, 6), "hidden": rng.randint(3, 8), "out": rng.randint(2, 4)}
    loss = fixed.get("loss", rng.choice(["ce", "mse"]))
    splits, heads = [], []
    for _ in range(steps):
        step_split, step_heads = _step(rng, norm, world, micro)
        splits.append(step_split)
        heads.append(step_heads)
    zero_stage = rng.choice([0, 0, 1, 2])
    weights = [rng.choice([0.0, 1.0, 2.0, 3.0, round(rng.uniform(0.1, 4), 2)]) for _ in range(world)]
    if sum(weights) == 0:
        weights[rng.randrange(world)] = 1.0
    big = 25 << 20
    cfg = {
        "seed": seed,
        "world": world,
        "model": model,
        "dims": dims,
        "loss": loss,
        "steps": steps,
        "micro": micro,
        "splits": splits,
        "heads": heads if "unused" in zoo.parts(model) else None,
        "optimizer": _optimizer(rng),
        "zero": {"stage": zero_stage, "weights": weights},
        "clip": rng.choice([None, None, 0.05, 0.5, 5.0]),
        "zero_grad_to_none": rng.random() < 0.6,
        "ddp": {
            "first_bucket_bytes": rng.choice([1 << 20, 256, 64]),
            "bucket_cap_bytes": rng.choice([big, 512, 128]),
            "gradient_as_bucket_view": rng.random() < 0.7,
            "find_unused_parameters": "unused" in zoo.parts(model) or rng.random() < 0.2,
        },
    }
    # Axes added later, drawn last so that a seed keeps its earlier axes.
    if rng.random() < 0.3:  # a second parameter group: fc2 and head, other lr and decay
        cfg["optimizer"]["second_group"] = {"lr_scale": rng.choice([0.5, 2.0]),
                                            "weight_decay": rng.choice([0.0, 0.02])}
    cfg["lr_decay"] = rng.choice([None, None, 0.5, 0.9])  # lr x this after every step
    cfg["checkpoint"] = rng.random() < 0.3  # activation checkpointing of a block (C++)
    cfg["ddp"]["buffer_sync"] = rng.choice(["with_gradients", "with_gradients", "before_forward"])
    cfg["ddp"]["rebuild_buckets"] = rng.random() < 0.7
    cfg["zero"]["gather_chunk_bytes"] = rng.choice([25 << 20, 256, 64])
    cfg["scaler"] = None
    if rng.random() < 0.3:  # hddp::GradScaler vs torch.amp.GradScaler, in float64
        cfg["scaler"] = {"init_scale": 2.0 ** rng.choice([0, 4, 10]),
                         "growth_interval": rng.choice([1, 2, 3]),
                         "overflow_step": rng.choice([None, rng.randrange(steps)]),
                         "overflow_rank": rng.randrange(world)}
    # Ranks other than 0 start from other values: DDP's broadcast at construction must
    # replace them (parameters, buffers, a frozen parameter).
    cfg["broadcast"] = world > 1 and rng.random() < 0.3
    cfg["frozen"] = "fc2.bias" if rng.random() < 0.2 else None  # requires_grad false
    # A rank without samples runs forward and backward on an empty batch (NaN mean loss)
    # instead of calling finalize(); not through BatchNorm.
    cfg["empty_forward"] = norm is None and rng.random() < 0.3
    # Buffers other than plain BatchNorm's are equal on every rank anyway (SyncBatchNorm's)
    # or absent: no sync and sparse syncs must leave them so.
    if norm != "bn" and rng.random() < 0.3:
        cfg["ddp"]["buffer_sync"] = rng.choice(["none", "with_gradients"])
        cfg["ddp"]["buffer_sync_interval"] = rng.randint(1, 3)
    else:
        cfg["ddp"]["buffer_sync_interval"] = 1
    # Axes of version 2 (#49 part 1), drawn after the others (a seed keeps its earlier
    # axes) and settled against them in _settle() once the pinned keys are in.
    u = rng.random()
    kind = "fp16" if u < 0.1 else "bf16" if u < 0.2 else "powersgd" if u < 0.4 else None
    cfg["compression"] = _compression(rng, kind) if kind else None
    cfg["autocast"] = rng.random() < 0.15  # bf16 autocast, the model in float32
    cfg["resume"] = {} if rng.random() < 0.25 else None  # save after step k, resume on M ranks
    for key, value in fixed.items():
        if key in ("world", "model", "micro", "steps"):
            continue
        assert key in cfg, f"unknown configuration key {key!r}"
        if key == "optimizer" and value.get("kind", cfg[key]["kind"]) != cfg[key]["kind"]:
            cfg[key] = dict(_optimizer(random.Random(seed), value["kind"]),
                            second_group=cfg[key].get("second_group"))
        if key == "compression" and value and (cfg[key] or {}).get("kind") != value.get("kind"):
            cfg[key] = _compression(random.Random(seed), value["kind"])
        if key == "resume" and value is not None and cfg[key] is None:
            cfg[key] = {}
        value = copy.deepcopy(value)  # _settle() completes dicts in place: not the caller's
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) and cfg[key] else value
    _settle(cfg, rng, set(fixed))
    if cfg["zero"]["stage"]:
        cfg["zero_grad_to_none"] = True  # ShardedOptimizer::zeroGrad sets them to none
    else:
        cfg["zero"]["weights"] = []
        if cfg["resume"] is not None:
            cfg["resume"]["weights"] = []
    return cfg


def _scaler(sc):
    if sc is None:
        return ""
    inf = "" if sc["overflow_step"] is None else f",inf@{sc['overflow_step']}/r{sc['overflow_rank']}"
    return f" scaler({sc['init_scale']:g},g{sc['growth_interval']}{inf})"


def summary(cfg):
    """One short line: the axes of the configuration."""
    o = cfg["optimizer"]
    if o["kind"] == "sgd":
        opt = f"sgd(m={o['momentum']:g}{',nest' if o['nesterov'] else ''}" \
              f"{',damp' if o['dampening'] else ''},wd={o['weight_decay']:g})"
    else:
        opt = f"{o['kind']}(wd={o['weight_decay']:g}{',ams' if o['amsgrad'] else ''})"
    if o.get("second_group"):
        g = o["second_group"]
        opt += f"+group(lr*{g['lr_scale']:g},wd={g['weight_decay']:g})"
    z = cfg["zero"]
    zero = f"zero{z['stage']}" + (":" + "/".join(f"{w:g}" for w in z["weights"]) if z["stage"] else "")
    split = "|".join(",".join(":".join(str(c) for c in m) for m in s) for s in cfg["splits"])
    if cfg["heads"] is not None:  # which ranks use the head, per micro-step
        split += " heads=" + "|".join(",".join("".join("h" if f else "-" for f in m) for m in s)
                                      for s in cfg["heads"])
    d = cfg["ddp"]
    c, r = cfg.get("compression"), cfg.get("resume")
    extra = ""
    if c and c["kind"] == "powersgd":
        extra += (f" powersgd(r{c['rank']},start{c['start']}{',ef' if c['error_feedback'] else ''}"
                  f"{',warm' if c['warm_start'] else ''})")
    elif c:
        extra += " " + c["kind"]
    extra += " autocast" if cfg.get("autocast") else ""
    if r:
        extra += f" resume@{r['at']}->w{r['world']}" + \
            (":" + "/".join(f"{w:g}" for w in r["weights"]) if r["weights"] else "")
    return (f"seed={cfg['seed']} w={cfg['world']} {cfg['model']} {cfg['loss']} {opt} {zero}{extra}"
            f" clip={cfg['clip']} micro={cfg['micro']} steps={cfg['steps']}"
            f"{' decay=%g' % cfg['lr_decay'] if cfg['lr_decay'] else ''}"
            f"{' ckpt' if cfg['checkpoint'] else ''}"
            f"{_scaler(cfg['scaler'])}"
            f"{' bcast' if cfg['broadcast'] else ''}"
            f"{' frozen=' + cfg['frozen'] if cfg['frozen'] else ''}"
            f"{' emptyfwd' if cfg['empty_forward'] else ''}"
            f"{' bufsync=fwd' if d['buffer_sync'] == 'before_forward' else ''}"
            f"{' bufsync=none' if d['buffer_sync'] == 'none' else ''}"
            f"{' bufsync/%d' % d['buffer_sync_interval'] if d['buffer_sync_interval'] > 1 else ''}"
            f"{'' if d['rebuild_buckets'] else ' norebuild'}"
            f"{' none' if cfg['zero_grad_to_none'] else ' zeros'}"
            f"{' view' if d['gradient_as_bucket_view'] else ' copy'}"
            f"{' fup' if d['find_unused_parameters'] else ''} split={split}")


def axes(cfg):
    """The features a configuration exercises, as tags (matrix.py counts them)."""
    o, d, z, sc = cfg["optimizer"], cfg["ddp"], cfg["zero"], cfg["scaler"]
    world, splits = cfg["world"], cfg["splits"]
    tags = [f"world {world}", o["kind"], f"zero {z['stage']}"]
    tags += ["model " + p for p in sorted(zoo.parts(cfg["model"]))] or ["model mlp"]
    if "+" in cfg["model"]:
        tags.append("a combined model")
    several = [step for step in splits if len(step[0]) > 1]  # steps on more than one rank
    zero_share = any(c == 0 for step in several for counts in step for c in counts)
    idle_step = any(all(counts[r] == 0 for counts in step)
                    for step in several for r in range(len(step[0])))
    late_zero = any(step[-1][r] == 0 and any(counts[r] for counts in step[:-1])
                    for step in several for r in range(len(step[0])))
    flags = {
        "a zero share": zero_share,
        "a rank idle for a whole step": idle_step,
        "finalize() after accumulated micro-steps": late_zero,
        "accumulation (noSync)": cfg["micro"] > 1,
        "clipping": cfg["clip"] is not None,
        "momentum": o.get("momentum", 0) > 0,
        "nesterov": o.get("nesterov", False),
        "dampening": o.get("dampening", 0) > 0,
        "amsgrad": o.get("amsgrad", False),
        "weight decay": o["weight_decay"] > 0,
        "two parameter groups": bool(o.get("second_group")),
        "lr decay": bool(cfg["lr_decay"]),
        "GradScaler": sc is not None,
        "GradScaler overflow": sc is not None and sc["overflow_step"] is not None,
        "activation checkpointing": cfg["checkpoint"],
        "broadcast at construction": cfg["broadcast"],
        "a frozen parameter": bool(cfg["frozen"]),
        "empty forward on a zero share": cfg["empty_forward"] and zero_share and world > 1,
        "zero_grad to zeros": not cfg["zero_grad_to_none"],
        "gradient copies (no bucket views)": not d["gradient_as_bucket_view"],
        "findUnusedParameters": d["find_unused_parameters"],
        "no bucket rebuild": not d["rebuild_buckets"],
        "several buckets": d["bucket_cap_bytes"] < 1024 or d["first_bucket_bytes"] < 1024,
        "buffer sync before forward": d["buffer_sync"] == "before_forward",
        "buffer sync none or sparse": d["buffer_sync"] == "none" or d["buffer_sync_interval"] > 1,
        "ZeRO rank without a shard": z["stage"] > 0 and 0.0 in z["weights"] and world > 1,
    }
    c, r = cfg.get("compression"), cfg.get("resume")
    if c:
        tags.append("compression " + c["kind"])
        if c["kind"] == "powersgd":
            flags["PowerSGD error feedback"] = c["error_feedback"]
            flags["PowerSGD warm start"] = c["warm_start"]
            flags["PowerSGD rank > 1"] = c["rank"] > 1
            flags["PowerSGD compressing a matrix"] = c["start"] < cfg["steps"] and compresses(cfg)
    flags["bf16 autocast"] = bool(cfg.get("autocast"))
    if r:
        flags["resume"] = True
        flags["resume on another world size"] = r["world"] != world
        flags["resume with ZeRO (N shards into M)"] = z["stage"] > 0
    return tags + [k for k, v in flags.items() if v]


def write(cfg, folder):
    """Writes case.json and data.safetensors for `cfg` into `folder`."""
    os.makedirs(folder, exist_ok=True)
    seed = cfg["seed"]
    model = zoo.make(cfg, seed)
    tensors = {f"init/{k}": v.contiguous() for k, v in zoo.state_dict(model).items()}
    g = torch.Generator().manual_seed(seed * 7919 + 17)
    d = cfg["dims"]
    for s, step in enumerate(cfg["splits"]):
        for m, counts in enumerate(step):
            n = sum(counts)
            tensors[f"x/{s}/{m}"] = torch.randn(n, d["in"], generator=g, dtype=torch.float64)
            if cfg["loss"] == "ce":
                tensors[f"y/{s}/{m}"] = torch.randint(0, d["out"], (n,), generator=g)
            else:
                tensors[f"y/{s}/{m}"] = torch.randn(n, d["out"], generator=g, dtype=torch.float64)
    if cfg["autocast"]:  # the model in float32 (bf16 autocast leaves float64 alone)
        tensors = {k: v.float() if v.dtype == torch.float64 else v for k, v in tensors.items()}
    # A tied weight is one tensor under two names: safetensors wants separate storage.
    save_file({k: v.clone() for k, v in tensors.items()}, os.path.join(folder, "data.safetensors"))
    with open(os.path.join(folder, "case.json"), "w") as f:
        json.dump(cfg, f, indent=1)
