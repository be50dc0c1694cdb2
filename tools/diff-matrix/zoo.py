"""The model zoo of the differential matrix, defined alike in bench/diff_matrix.cpp
(same module names, same parameter and buffer names, same order of registration, same
arithmetic): what the C++ driver trains on N ranks and the reference trains here on one.

- mlp:    fc1 (Linear in->hidden), tanh, fc2 (Linear hidden->out)
- bn:     fc1 (without bias: BatchNorm removes it, so its true gradient is 0 and what
          Adam makes of the rounding noise, +-lr x noise/eps, is no reference's to match),
          bn (BatchNorm1d, train mode), tanh, fc2
- syncbn: as bn; the C++ side holds an hddp::SyncBatchNorm under the same name
- tied:   fc1, tanh, enc (hidden->hidden), tanh, dec (whose weight IS enc.weight), tanh, fc2
- unused: fc1, tanh, fc2, plus head (Linear in->out) added to the output of the samples
          whose rank uses it in that micro-step (possibly none: then it has no gradient)

A model may combine them: "syncbn+tied+unused" (a normalisation, then tied, then
unused, joined by "+"); "mlp" is none of them.

With "checkpoint" in a configuration the C++ side recomputes a block in backward
(hddp::checkpoint: enc/dec of "tied", fc2 otherwise); the reference does not, as the
result is the same arithmetic.
"""
import torch
from torch import nn

KINDS = ("mlp", "bn", "syncbn", "tied", "unused")


def parts(kind):
    """The parts of a model name: {"bn"} or {"syncbn"} or neither, "tied", "unused"."""
    p = set(kind.split("+")) - {"mlp"}
    assert p <= set(KINDS) and not {"bn", "syncbn"} <= p, kind
    return p


def norm(kind):
    """ "bn", "syncbn" or None."""
    p = parts(kind)
    return "bn" if "bn" in p else "syncbn" if "syncbn" in p else None


class Zoo(nn.Module):
    def __init__(self, kind, d_in, hidden, d_out):
        super().__init__()
        p = parts(kind)
        self.kind, self.tied, self.unused = kind, "tied" in p, "unused" in p
        self.fc1 = nn.Linear(d_in, hidden, bias=norm(kind) is None)
        if norm(kind):
            self.bn = nn.BatchNorm1d(hidden)
        if self.tied:
            self.enc = nn.Linear(hidden, hidden)
            self.dec = nn.Linear(hidden, hidden)
            self.dec.weight = self.enc.weight  # one tensor under two names
        self.fc2 = nn.Linear(hidden, d_out)
        if self.unused:
            self.head = nn.Linear(d_in, d_out)

    def forward(self, x, head_mask=None):
        h = self.fc1(x)
        if norm(self.kind):
            h = self.bn(h)
        h = torch.tanh(h)
        if self.tied:
            h = torch.tanh(self.dec(torch.tanh(self.enc(h))))
        y = self.fc2(h)
        if self.unused and head_mask is not None and bool(head_mask.any()):
            idx = head_mask.nonzero().squeeze(1)
            y = y.index_add(0, idx, self.head(x.index_select(0, idx)))
        return y


def make(cfg, seed):
    """The model of a case with its initial weights (float64, from `seed`)."""
    d = cfg["dims"]
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Zoo(cfg["model"], d["in"], d["hidden"], d["out"]).double()
    if norm(cfg["model"]):
        with torch.no_grad():  # running statistics that are not the defaults
            model.bn.weight.uniform_(0.5, 1.5)
            model.bn.bias.uniform_(-0.2, 0.2)
            model.bn.running_mean.uniform_(-0.1, 0.1)
            model.bn.running_var.uniform_(0.8, 1.2)
    torch.random.set_rng_state(gen_state)
    return model


def state_dict(model):
    """Every parameter (a tied one under each of its names) and buffer, detached."""
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
