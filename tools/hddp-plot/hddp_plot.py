"""hddp-plot: charts of an hddp run from its metrics files (all ranks).

  hddp-plot run/metrics.jsonl                 -> run/metrics.png and run/metrics.svg
  hddp-plot run/metrics.jsonl -o out/run --format png

Reads rank 0's file and its siblings NAME.rank<r>.jsonl (TrainerOptions::metricsPath,
the trainers' --metrics) and draws, over the steps: the loss (all ranks' samples) and
the test metrics at each epoch's end, the global samples/s, each rank's share of the
global batch with the planner's changes marked, each rank's memory, and each rank's
mean step time split into compute, emulated time, communication wait and data wait.
The title gives the run's configuration (the metrics' "config" record).

The plotting functions are also what the benchmarks draw their charts with
(bench/hetero_compare.py).
"""
import argparse
import glob
import json
import math
import os
import re
import sys

MIB = 1024.0 * 1024.0
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def matplotlib_pyplot():
    """pyplot on the Agg backend (no display needed), or exit saying how to get it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        sys.exit("hddp-plot: matplotlib is missing from " + sys.executable +
                 ": pip install matplotlib (scripts/setup.sh installs it next to the torch wheel)")


class PlotError(Exception):
    pass


# ---- reading -------------------------------------------------------------------------

def rank_files(path):
    """Rank 0's metrics file and its siblings NAME.rank<r>.jsonl, by rank."""
    if not os.path.isfile(path):
        raise PlotError(f"{path}: no such file (give rank 0's metrics file, e.g. run/metrics.jsonl)")
    stem, ext = os.path.splitext(path)
    files = {0: path}
    for other in glob.glob(glob.escape(stem) + ".rank*" + ext):
        m = re.search(r"\.rank(\d+)" + re.escape(ext) + "$", other)
        if m:
            files[int(m.group(1))] = other
    return dict(sorted(files.items()))


def read_records(path):
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                # A run killed mid-write leaves a torn last line: skip it, say so.
                print(f"hddp-plot: {path}:{n}: skipped a line that is not JSON ({e.msg})", file=sys.stderr)
    return records


class Run:
    """The records of one run, by rank. A step trained twice (a resumed or elastic run
    repeats the steps after its last commit) counts once: the last record of it."""

    def __init__(self, path):
        self.path = path
        self.ranks = {}
        for rank, file in rank_files(path).items():
            recs = read_records(file)
            steps = {}
            for r in recs:
                if r.get("kind") == "step":
                    steps[r["step"]] = r
            self.ranks[rank] = {
                "steps": [steps[s] for s in sorted(steps)],
                "epochs": [r for r in recs if r.get("kind") == "epoch"],
                "evaluations": [r for r in recs if r.get("kind") == "evaluation"],
                "summary": next((r for r in reversed(recs) if r.get("kind") == "summary"), None),
                "config": next((r for r in reversed(recs) if r.get("kind") == "config"), None),
                "out_of_memory": [r for r in recs if r.get("kind") == "out_of_memory"],
            }
        if not self.ranks[0]["steps"]:
            raise PlotError(f"{path}: no step records (is it an hddp metrics file of a run that trained?)")

    def steps(self, rank=0):
        return self.ranks[rank]["steps"]

    def global_loss(self):
        """Per step, the mean loss over every rank's samples."""
        by_step = {}
        for data in self.ranks.values():
            for s in data["steps"]:
                total, n = by_step.get(s["step"], (0.0, 0))
                by_step[s["step"]] = (total + s["loss"] * s["local_batch"], n + s["local_batch"])
        xs = sorted(x for x, (_, n) in by_step.items() if n > 0)
        return xs, [by_step[x][0] / by_step[x][1] for x in xs]

    def epoch_metrics(self):
        """Rank 0's evaluations: {name: [(step, value)]}, at each epoch's last step."""
        last_step = {}
        for s in self.steps():
            last_step[s["epoch"]] = s["step"]
        out = {}
        skip = {"kind", "rank", "epoch", "steps", "seconds", "samples_per_s", "train_loss", "plan",
                "peak_memory_bytes"}
        for e in self.ranks[0]["epochs"]:
            for k, v in e.items():
                if k not in skip and isinstance(v, (int, float)) and e["epoch"] in last_step:
                    out.setdefault(k, []).append((last_step[e["epoch"]], v))
        for e in self.ranks[0]["evaluations"]:
            for k, v in e.items():
                if k not in ("kind", "rank", "epoch", "step") and isinstance(v, (int, float)):
                    out.setdefault(k, []).append((e["step"], v))
        return out

    def title(self):
        c = self.ranks[0]["config"] or {}
        n = c.get("world_size", len(self.ranks))
        devices = [(self.ranks[r]["config"] or {}).get("device", "?") for r in self.ranks]
        parts = [f"{n} rank(s) ({', '.join(devices)})"]
        if "global_batch" in c:
            parts.append(f"global batch {c['global_batch']}")
        if "amp" in c:
            parts.append(f"amp {c['amp']}")
        if "balance" in c:
            parts.append("planner" if c["balance"] else "equal split")
        emulated = []
        for r, data in self.ranks.items():
            e = (data["config"] or {}).get("emulation")
            if e:
                what = []
                if e.get("slowdown", 1) != 1:
                    what.append(f"x{e['slowdown']:g} compute")
                if e.get("link_GBps", 0) > 0:
                    what.append(f"{e['link_GBps']:g} GB/s link")
                if e.get("memory_total_bytes", 0) > 0:
                    what.append(f"{e['memory_total_bytes'] / MIB:.0f} MiB")
                if e.get("memory_cap_samples", 0) > 0:
                    what.append(f"cap {e['memory_cap_samples']}")
                if what:
                    emulated.append(f"rank {r} " + ", ".join(what))
        if emulated:
            parts.append("EMULATED: " + "; ".join(emulated))
        s = self.ranks[0]["summary"]
        tail = f"{len(self.steps())} steps"
        if s:
            tail += f", {s['samples_per_s']:.0f} samples/s"
        return "hddp run: " + ", ".join(parts) + "\n" + os.path.basename(self.path) + ": " + tail


# ---- drawing -------------------------------------------------------------------------

def smooth(values, window):
    """A centred moving median (robust to the odd slow step)."""
    if window <= 1 or len(values) < 3:
        return list(values)
    half = window // 2
    out = []
    for i in range(len(values)):
        part = sorted(values[max(0, i - half):i + half + 1])
        out.append(part[len(part) // 2])
    return out


def share_panel(ax, steps, shares, changes=(), best=(), labels=None):
    """Each rank's share of the global batch over the steps.

    shares: {rank: [share per step]}; changes: steps at which the plan changed (dotted
    verticals); best: (x0, x1, share, label) segments drawn dashed in rank 1's colour."""
    for r, ys in sorted(shares.items()):
        label = labels[r] if labels else f"rank {r}"
        ax.step(steps, ys, where="post", color=COLORS[r % len(COLORS)], label=label, linewidth=1.6)
    for i, x in enumerate(changes):
        ax.axvline(x, color="0.6", linestyle=":", linewidth=1, label="plan changed" if i == 0 else None)
    for i, (x0, x1, y, label) in enumerate(best):
        ax.hlines(y, x0, x1, colors=COLORS[1], linestyles="--", linewidth=1.4, label=label if label else None)
    ax.set_ylim(0, 1)
    ax.set_xlabel("step")
    ax.set_ylabel("share of the global batch")
    ax.set_title("each rank's share")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def step_split_panel(ax, run):
    parts = [("compute", "#1f77b4"), ("emulated", "#aec7e8"), ("communication wait", "#ff7f0e"),
             ("data wait", "#2ca02c"), ("other", "#c7c7c7")]
    ranks = sorted(run.ranks)
    bottoms = [0.0] * len(ranks)
    means = {name: [] for name, _ in parts}
    for r in ranks:
        steps = run.steps(r)
        n = max(1, len(steps))
        emulated = sum(s.get("emulated_s", 0.0) for s in steps) / n
        compute = sum(s["compute_s"] for s in steps) / n - emulated
        comm = sum(s["comm_wait_s"] for s in steps) / n
        data = sum(s["data_wait_s"] for s in steps) / n
        total = sum(s["step_s"] for s in steps) / n
        values = [compute, emulated, comm, data, max(0.0, total - compute - emulated - comm - data)]
        for (name, _), v in zip(parts, values):
            means[name].append(v * 1e3)
    for name, color in parts:
        if not any(v > 0 for v in means[name]):
            continue
        ax.bar([str(r) for r in ranks], means[name], bottom=bottoms, color=color, label=name)
        bottoms = [b + v for b, v in zip(bottoms, means[name])]
    ax.set_xlabel("rank")
    ax.set_ylabel("ms per step (mean)")
    ax.set_title("where each rank's step time goes")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def memory_panel(ax, run):
    drawn = False
    for r in sorted(run.ranks):
        xs, ys, total, cap = [], [], None, None
        kind = None
        for s in run.steps(r):
            m = s.get("memory")
            if not m:
                continue
            if "peak_allocated_bytes" in m:
                kind = "peak allocated" + (" (emulated)" if m.get("emulated") else "")
                ys.append(m["peak_allocated_bytes"] / MIB)
                total = m.get("total_bytes", total)
            else:
                kind = "resident set"
                ys.append(m["resident_bytes"] / MIB)
            xs.append(s["step"])
        if not xs:
            continue
        drawn = True
        color = COLORS[r % len(COLORS)]
        ax.plot(xs, ys, color=color, label=f"rank {r}: {kind}", linewidth=1.4)
        if total:
            ax.axhline(total / MIB, color=color, linestyle="--", linewidth=1, label=f"rank {r}: device total")
    if not drawn:
        ax.text(0.5, 0.5, "no memory in these metrics\n(written by an older hddp)", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    ax.set_title("memory per rank")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8, loc="best")


def loss_panel(ax, run):
    xs, ys = run.global_loss()
    ax.plot(xs, ys, color="0.75", linewidth=0.8, label="loss per step")
    ax.plot(xs, smooth(ys, 9), color=COLORS[0], linewidth=1.6, label="moving median of 9")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (all ranks' samples)")
    ax.set_title("loss and test metrics")
    ax.grid(alpha=0.3)
    metrics = run.epoch_metrics()
    handles, labels = ax.get_legend_handles_labels()
    if metrics:
        right = ax.twinx()
        for i, (name, points) in enumerate(sorted(metrics.items())):
            px, py = zip(*points)
            right.plot(px, py, marker="o", color=COLORS[(i + 2) % len(COLORS)], linewidth=1.2, label=name)
        right.set_ylabel("test metrics (at each epoch's end)")
        h2, l2 = right.get_legend_handles_labels()
        handles += h2
        labels += l2
    ax.legend(handles, labels, fontsize=8, loc="best")


def throughput_panel(ax, run):
    steps = run.steps()
    xs = [s["step"] for s in steps]
    ys = [s["samples_per_s"] for s in steps]
    ax.plot(xs, ys, color="0.75", linewidth=0.8, label="per step")
    ax.plot(xs, smooth(ys, 9), color=COLORS[0], linewidth=1.6, label="moving median of 9")
    s = run.ranks[0]["summary"]
    if s:
        ax.axhline(s["samples_per_s"], color=COLORS[3], linestyle="--", linewidth=1,
                   label=f"run: {s['samples_per_s']:.0f} (evaluation included)")
    ax.set_xlabel("step")
    ax.set_ylabel("samples/s (global)")
    ax.set_title("throughput")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def shares_of(run):
    steps = run.steps()
    xs = [s["step"] for s in steps]
    shares = {}
    for r in sorted(run.ranks):
        n = len(steps[0]["plan"]) if steps[0].get("plan") else 0
        if r < n:
            shares[r] = [s["plan"][r] / s["global_batch"] for s in steps]
    changes = [s["step"] for s in steps if "new_plan" in s]
    return xs, shares, changes


def save(fig, prefix, formats):
    written = []
    folder = os.path.dirname(prefix)
    if folder:
        os.makedirs(folder, exist_ok=True)
    for fmt in formats:
        path = f"{prefix}.{fmt}"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        written.append(path)
    return written


def plot_run(run, prefix, formats):
    plt = matplotlib_pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    loss_panel(axes[0][0], run)
    throughput_panel(axes[0][1], run)
    xs, shares, changes = shares_of(run)
    share_panel(axes[0][2], xs, shares, changes)
    step_split_panel(axes[1][0], run)
    memory_panel(axes[1][1], run)
    summary_panel(axes[1][2], run)
    fig.suptitle(run.title(), fontsize=11)
    fig.tight_layout()
    written = save(fig, prefix, formats)
    plt.close(fig)
    return written


def summary_panel(ax, run):
    ax.axis("off")
    lines = []
    s = run.ranks[0]["summary"]
    if s:
        lines.append(f"steps: {s['steps']} ({s['total_steps']} in all), epochs {s['epochs_completed']}")
        lines.append(f"time: {s['seconds']:.1f} s, {s['samples_per_s']:.1f} samples/s")
        if s.get("train_loss") is None:  # no epoch completed (--max-steps, the time budget)
            lines.append("final training loss: none (no epoch completed)")
        else:
            lines.append(f"final training loss: {s['train_loss']:.4f}")
        for k, v in sorted(s.items()):
            if k.startswith("test") or k.startswith("val"):
                lines.append(f"{k}: {v:.4f}")
        if s.get("repeated_steps"):
            lines.append(f"steps repeated after out of memory: {s['repeated_steps']}")
    else:
        lines.append("no summary record: the run did not finish (or is still running)")
    for r in sorted(run.ranks):
        peak = (run.ranks[r]["summary"] or {}).get("peak_memory_bytes")
        if peak:
            lines.append(f"rank {r} peak memory: {peak / MIB:.1f} MiB")
    steps = run.steps()
    changes = sum(1 for x in steps if "new_plan" in x)
    lines.append(f"plan changes: {changes}")
    lines.append(f"split at the last step: {steps[-1]['plan']} of {steps[-1]['global_batch']}")
    ooms = len(run.ranks[0]["out_of_memory"])
    if ooms:
        lines.append(f"out-of-memory steps: {ooms}")
    ax.text(0.0, 1.0, "\n".join(lines), va="top", ha="left", family="monospace", fontsize=9,
            transform=ax.transAxes)
    ax.set_title("summary")


def main(argv=None):
    p = argparse.ArgumentParser(prog="hddp-plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", help="rank 0's metrics file (its NAME.rank<r>.jsonl siblings are read too)")
    p.add_argument("-o", "--output", help="output path without extension (default: the metrics path without .jsonl)")
    p.add_argument("--format", default="png,svg", help="comma-separated: png, svg, pdf (default png,svg)")
    a = p.parse_args(argv)
    formats = [f.strip().lower() for f in a.format.split(",") if f.strip()]
    bad = [f for f in formats if f not in ("png", "svg", "pdf")]
    if bad or not formats:
        p.error(f"--format {a.format}: give png, svg or pdf (comma-separated)")
    prefix = a.output or os.path.splitext(a.metrics)[0]
    try:
        run = Run(a.metrics)
        written = plot_run(run, prefix, formats)
    except PlotError as e:
        print(f"hddp-plot: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
