"""The reference: one process trains the whole global batch in float64 with PyTorch's
own optimizers, and the comparison of its final state with what each hddp rank wrote.

Single-device equivalent of hddp's weighting: every rank's gradient is its mean-loss
gradient x b_r / B, summed over ranks and over the micro-steps of the optimizer step, B
being the samples of the whole step. That is the gradient of (sum of per-sample losses
over the step) / B, which is what this reference backpropagates, micro-step by
micro-step (BatchNorm sees each micro-step's global micro-batch, as SyncBatchNorm does).
"""
import torch
import torch.nn.functional as F

import reference_ranks
import zoo


def make_optimizer(o, model):
    """torch.optim's optimizer of `o`; with a second group, fc2's and head's parameters
    in it with their own learning rate and weight decay."""
    params, second = [], []
    for name, p in model.named_parameters():
        (second if o.get("second_group") and name.split(".")[0] in ("fc2", "head") else params).append(p)
    groups = [{"params": params}]
    if second:
        g = o["second_group"]
        groups.append({"params": second, "lr": o["lr"] * g["lr_scale"], "weight_decay": g["weight_decay"]})
    if o["kind"] == "sgd":
        return torch.optim.SGD(groups, lr=o["lr"], momentum=o["momentum"], dampening=o["dampening"],
                               nesterov=o["nesterov"], weight_decay=o["weight_decay"])
    cls = torch.optim.Adam if o["kind"] == "adam" else torch.optim.AdamW
    return cls(groups, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
               weight_decay=o["weight_decay"], amsgrad=o["amsgrad"])


def loss_sum(cfg, out, y):
    """The sum over samples of each sample's loss (hddp's ranks take the mean over theirs)."""
    if cfg["loss"] == "ce":
        return F.cross_entropy(out, y, reduction="sum")
    return F.mse_loss(out, y, reduction="sum") / out.shape[1]


def train(cfg, tensors, lr_scale=1.0, layout=None):
    """Trains the case; returns the final {"param/..", "buffer/..", "state/../.."} tensors.
    `lr_scale` plants a wrong learning rate (to check that the comparison catches it).
    A case whose reduction rounds (compression, autocast) trains rank by rank
    (reference_ranks.py); `layout` is then hddp's bucket layout of each step, needed
    where a step runs on 3 ranks. A resumed case trains straight through."""
    model = zoo.make(cfg, cfg["seed"])
    if cfg.get("autocast"):
        model.float()  # the case's values are float32
    model.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("init/")})
    model.train()
    if cfg.get("frozen"):
        model.get_parameter(cfg["frozen"]).requires_grad_(False)
    o = dict(cfg["optimizer"], lr=cfg["optimizer"]["lr"] * lr_scale)
    opt = make_optimizer(o, model)
    sc = cfg.get("scaler")
    scaler = None
    if sc is not None:
        scaler = torch.amp.GradScaler("cpu", init_scale=sc["init_scale"],
                                      growth_interval=sc["growth_interval"])
    first = next(iter(model.parameters()))  # DDP's first parameter: fc1.weight
    per_rank = reference_ranks.needed(cfg)
    for s, step in enumerate(cfg["splits"]):
        opt.zero_grad(set_to_none=cfg["zero_grad_to_none"])
        total = sum(sum(counts) for counts in step)
        if per_rank:
            reference_ranks.backward_of_step(cfg, model, tensors, s, scaler,
                                             layout[s] if layout else None)
        for m, counts in enumerate([] if per_rank else step):
            x, y = tensors[f"x/{s}/{m}"], tensors[f"y/{s}/{m}"]
            mask = None
            if cfg["heads"] is not None:
                flags = cfg["heads"][s][m]
                mask = torch.tensor([flags[r] for r, c in enumerate(counts) for _ in range(c)],
                                    dtype=torch.bool)
            loss = loss_sum(cfg, model(x, mask), y) / total
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler is not None:
            if sc["overflow_step"] == s:
                with torch.no_grad():
                    first.grad.view(-1)[0] = float("inf")
            scaler.unscale_(opt)
        if cfg["clip"] is not None and cfg.get("autocast"):  # float32: hddp's arithmetic
            reference_ranks.clip(cfg, model, layout[s] if layout else None)
        elif cfg["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if cfg.get("lr_decay"):
            for group in opt.param_groups:
                group["lr"] *= cfg["lr_decay"]
    return final_state(model, opt, scaler)


def final_state(model, opt, scaler=None):
    """What the comparison reads: {"param/<name>", "buffer/<name>", "state/<name>/<key>",
    "scaler/..."}."""
    result = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        result[f"param/{name}"] = p.detach().clone()
    for name, b in model.named_buffers():
        result[f"buffer/{name}"] = b.detach().clone()
    for name, p in model.named_parameters():  # a tied tensor under its first name
        for key, value in opt.state.get(p, {}).items():
            if value is not None:
                result[f"state/{name}/{key}"] = torch.as_tensor(value).detach().clone()
    if scaler is not None:
        result["scaler/scale"] = torch.tensor(scaler.get_scale(), dtype=torch.float64)
        result["scaler/growth_tracker"] = torch.tensor(float(scaler._get_growth_tracker()),
                                                       dtype=torch.float64)
    return result


def compare(expected, ranks, zero_stage, rtol, floor):
    """Compares each rank's tensors with the reference. Parameters and buffers: every
    rank holds all of them. Optimizer state: every rank all of it (ZeRO 0), or each
    parameter's state on exactly one rank, its owner (ZeRO 1/2); what several ranks hold
    equal to rank 0's to the bit. Returns (worst absolute
    difference, worst relative difference, list of problems). Relative, per tensor: its
    max |difference| over max(its max |reference| value, floor); it passes when that is
    <= rtol."""
    worst_abs, worst_rel, problems = 0.0, 0.0, []

    def check(key, got, want, where):
        nonlocal worst_abs, worst_rel
        if tuple(got.shape) != tuple(want.shape):
            problems.append(f"{where} {key}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            return
        g, w = got.double().reshape(-1), want.double().reshape(-1)
        if not bool(torch.isfinite(g).all()):
            problems.append(f"{where} {key}: not finite")
            return
        diff = (g - w).abs().max().item() if g.numel() else 0.0
        scale = w.abs().max().item() if w.numel() else 0.0
        worst_abs = max(worst_abs, diff)
        rel = diff / max(scale, floor)
        worst_rel = max(worst_rel, rel)
        if not rel <= rtol:
            problems.append(f"{where} {key}: max |diff| {diff:.3g} (rel {rel:.3g})")

    for r, got in enumerate(ranks):
        for key, want in expected.items():
            if key.startswith("state/"):
                continue
            if key not in got:
                problems.append(f"rank {r}: {key} missing")
            else:
                check(key, got[key], want, f"rank {r}")
        extra = [k for k in got if not k.startswith("state/") and k not in expected]
        problems += [f"rank {r}: {k} not in the reference" for k in extra]
        # The ranks agree to the bit: the same sums (one allreduce, or one owner's
        # broadcast) and the same arithmetic on each.
        for key, value in got.items():
            if r > 0 and (zero_stage == 0 or not key.startswith("state/")) and key in ranks[0] and \
                    not torch.equal(value, ranks[0][key]):
                problems.append(f"rank {r}: {key} differs from rank 0's")
    want_state = {k: v for k, v in expected.items() if k.startswith("state/")}
    if zero_stage == 0:
        for r, got in enumerate(ranks):
            have = {k for k in got if k.startswith("state/")}
            for key in sorted(have - set(want_state)):
                problems.append(f"rank {r}: {key} not in the reference's optimizer state")
            for key in sorted(set(want_state) - have):
                problems.append(f"rank {r}: {key} missing from the optimizer state")
            for key in sorted(have & set(want_state)):
                check(key, got[key], want_state[key], f"rank {r}")
    else:
        holders = {}
        for r, got in enumerate(ranks):
            for key in got:
                if key.startswith("state/"):
                    holders.setdefault(key, []).append(r)
        for key in sorted(set(holders) - set(want_state)):
            problems.append(f"ranks {holders[key]}: {key} not in the reference's optimizer state")
        for key in sorted(set(want_state) - set(holders)):
            problems.append(f"{key} missing from every rank's optimizer state")
        for key in sorted(set(holders) & set(want_state)):
            if len(holders[key]) != 1:
                problems.append(f"{key} held by ranks {holders[key]}, one owner expected")
            for r in holders[key]:
                check(key, ranks[r][key], want_state[key], f"rank {r}")
    return worst_abs, worst_rel, problems
