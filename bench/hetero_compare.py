#!/usr/bin/env python3
"""Unlike ranks: equal split (PyTorch DDP's) vs hddp's planner, and adaptation.

2 CPU ranks train ResNet-20 (28x28 inputs, synthetic data, 1 thread each); rank 1 is
emulated --slowdown times slower (HDDP_EMULATE_SLOWDOWN, announced in its log). All in
one run:
  - ideal: both ranks alone at once (no communication), the sum of their samples/s;
  - equal split and planner: global samples/s as a fraction of the ideal; --rounds
    rounds of the three back to back, each against its own ideal, median reported;
  - adaptation: planner run in which rank 1's slowdown halves at --change-at; steps until
    rank 1's share is within 5% of the best share, and whether the share moves again
    afterwards (oscillation). The best share is given for the speeds the ranks measured
    after the change (on two shared cores rank 0 slows when rank 1 computes more) and
    for the nominal speeds, B/(k/2+1);
  - a chart of the shares (the best ones dashed) and step times over the adaptation
    run, drawn with hddp-plot's code (--svg, matplotlib);
  - where the planner's gap goes (from --trace): the ranks' own speed while they train
    together ("capacity", against the ideal) and the share of it the steps deliver.

  bench/hetero_compare.py --build build [--slowdown 3 --steps 60 --svg docs/hetero.svg]
"""
import argparse
import json
import os
import sys

from launch_json import run_json


def run(launcher, bench, mode, args, env, traces=None):
    extra = ["--trace"] if traces is not None else []
    rows = run_json([launcher, "--nproc-per-node", "2", "--no-prefix", "--", bench, "--mode", mode] + args + extra, env)
    if traces is not None:
        traces.extend(r for r in rows if r["kind"] == "trace")
    return [r for r in rows if r["kind"] == "step"], [r for r in rows if r["kind"] == "summary"]


def rank_rates(traces):
    """Each rank's samples/s while busy (compute plus emulated time, not waiting), timed steps."""
    rates = {}
    for r in sorted({t["rank"] for t in traces}):
        mine = [t for t in traces if t["rank"] == r and t["step"] >= 0]
        rates[r] = sum(t["local"] for t in mine) / sum(t["compute_s"] + t["emulated_s"] for t in mine)
    return rates


def chart(steps, B, change_at, best_before, best_after, k, path):
    """Rank 1's share (and rank 0's) over the adaptation run with the best shares dashed,
    and the step time, drawn with hddp-plot's code (tools/hddp-plot/hddp_plot.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "hddp-plot"))
    import hddp_plot
    plt = hddp_plot.matplotlib_pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    xs = [s["step"] for s in steps]
    shares = {r: [s["local"][r] / B for s in steps] for r in range(len(steps[0]["local"]))}
    changes = [cur["step"] for prev, cur in zip(steps, steps[1:]) if cur["local"] != prev["local"]]
    hddp_plot.share_panel(top, xs, shares, changes,
                          best=[(xs[0], change_at, best_before / B, "rank 1's best share"),
                                (change_at, xs[-1], best_after / B, None)])
    top.set_xlabel("")
    top.set_ylim(0, 1)
    top.set_title(f"2 CPU ranks, ResNet-20, global batch {B}: rank 1 emulated {k:g}x slower, "
                  f"{k / 2:g}x from step {change_at}", fontsize=10)
    for ax in (top, bottom):
        ax.axvline(change_at, color="k", linewidth=1)
    top.annotate("rank 1 speeds up 2x", (change_at, 0.93), xytext=(4, 0), textcoords="offset points", fontsize=9)
    times = [s["step_seconds"] for s in steps]
    bottom.plot(xs, times, color="0.7", linewidth=0.8, label="per step")
    bottom.plot(xs, hddp_plot.smooth(times, 5), color=hddp_plot.COLORS[3], linewidth=1.6, label="moving median of 5")
    bottom.set_ylim(0, max(times) * 1.1)
    bottom.set_xlabel("step")
    bottom.set_ylabel("step time (s)")
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8, loc="best")
    fig.tight_layout()
    stem, ext = os.path.splitext(path)
    hddp_plot.save(fig, stem, [ext.lstrip(".") or "svg"])
    plt.close(fig)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.path.join(here, "..", "build"))
    p.add_argument("--slowdown", type=float, default=3.0)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--change-at", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3, help="solo/equal/planner rounds; the median fraction is reported")
    p.add_argument("--svg", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    launcher = os.path.join(a.build, "tools", "hddp-run", "hddp-run")
    bench = os.path.join(a.build, "bench", "hetero_bench")
    env = dict(os.environ, OMP_NUM_THREADS="1", HDDP_LOG_LEVEL="warn", HDDP_EMULATE_SLOWDOWN="1:%g" % a.slowdown)
    B, k = a.global_batch, a.slowdown
    common = ["--global-batch", str(B), "--steps", str(a.steps)]
    # Rounds of solo, equal, planner back to back: each round's fractions use its own
    # ideal, so a slow spell of this shared machine moves a round, not the median.
    rounds = []
    for i in range(a.rounds):
        _, solo = run(launcher, bench, "solo", common, env)
        ideal = sum(r["solo_samples_per_s"] for r in solo)
        _, equal = run(launcher, bench, "equal", common, env)
        traces = []
        plan_steps, planner = run(launcher, bench, "planner", common, env, traces)
        # Where the planner's gap to the ideal goes: the ranks' own speed while they
        # train together (capacity), and the share of that capacity the steps deliver
        # (what the split and the synchronisation lose).
        capacity = sum(rank_rates(traces).values())
        rounds.append({"ideal": ideal, "solo": [r["solo_samples_per_s"] for r in solo],
                       "planner_capacity": capacity,
                       "planner_of_capacity": planner[0]["global_samples_per_s"] / capacity,
                       "equal": equal[0]["global_samples_per_s"], "planner": planner[0]["global_samples_per_s"],
                       "equal_fraction": equal[0]["global_samples_per_s"] / ideal,
                       "planner_fraction": planner[0]["global_samples_per_s"] / ideal,
                       "final_split": plan_steps[-1]["local"]})
    median = lambda v: sorted(v)[len(v) // 2]
    eq = median([r["equal_fraction"] for r in rounds])
    pl = median([r["planner_fraction"] for r in rounds])
    print(f"2 CPU ranks, ResNet-20 28x28, global batch {B}, rank 1 emulated {k:g}x slower, {a.steps} steps, {a.rounds} round(s)")
    for i, r in enumerate(rounds):
        print(f"  round {i + 1}: ideal (solo, at once) {r['ideal']:.1f} samples/s (rank 0 {r['solo'][0]:.1f}, rank 1 {r['solo'][1]:.1f}); "
              f"equal {r['equal']:.1f} = {r['equal_fraction']:.3f}; planner {r['planner']:.1f} = {r['planner_fraction']:.3f}, "
              f"final split {r['final_split']}; ranks' own speed in the planner run {r['planner_capacity']:.1f} samples/s "
              f"({r['planner_capacity'] / r['ideal']:.3f} of ideal), planner delivers {r['planner_of_capacity']:.3f} of it")
    print(f"  equal split:  median {eq:.3f} of ideal (theory 2/(k+1) = {2 / (k + 1):.3f})")
    print(f"  hddp planner: median {pl:.3f} of ideal; of the ranks' own speed in the same run: median "
          f"{median([r['planner_of_capacity'] for r in rounds]):.3f}")
    # Adaptation: rank 1's slowdown k -> k/2 at change_at.
    total = a.change_at + a.steps
    adapt_traces = []
    adapt_steps, _ = run(launcher, bench, "planner", ["--global-batch", str(B), "--steps", str(total),
                                                      "--change-at", str(a.change_at), "--change-to", str(k / 2)],
                         env, adapt_traces)
    nominal_best = B / (k / 2 + 1)
    # The best share for the speeds the ranks really had after the change: on two
    # shared cores a rank's speed depends on what the other runs beside it, so the
    # nominal share (rank 0's speed unchanged) is not the one that balances the steps.
    # Each rank's seconds per sample over the last half of the run after the change.
    tail = [t for t in adapt_traces if t["step"] >= a.change_at + a.steps // 2 and t["local"] > 0]
    per = {r: sum(t["compute_s"] + t["emulated_s"] for t in tail if t["rank"] == r) /
           sum(t["local"] for t in tail if t["rank"] == r) for r in (0, 1)}
    measured_best = B * (1 / per[1]) / (1 / per[0] + 1 / per[1])

    def settle(best):
        within = None
        for s in adapt_steps[a.change_at:]:
            if abs(s["local"][1] - best) <= 0.05 * best:
                within = s["step"] - a.change_at
                break
        changes = reversals = 0
        worst = 0.0
        if within is not None:
            settled = [s["local"][1] for s in adapt_steps[a.change_at + within:]]
            moves = [y - x for x, y in zip(settled, settled[1:]) if y != x]
            changes = len(moves)
            reversals = sum(1 for m, n in zip(moves, moves[1:]) if (m > 0) != (n > 0))
            worst = max(abs(x - best) / best for x in settled)
        return {"best": best, "steps_to_within_5pct": within, "changes": changes, "reversals": reversals,
                "worst_deviation": worst}

    after = adapt_steps[a.change_at:]
    moves = [y["local"][1] - x["local"][1] for x, y in zip(after, after[1:]) if y["local"] != x["local"]]
    print(f"  adaptation: rank 1 {k:g}x -> {k / 2:g}x slower at step {a.change_at}; plan moves after the change: "
          f"{len(moves)} ({', '.join('%+d' % m for m in moves)}), final share {after[-1]['local'][1]}")
    for name, best in (("measured", measured_best), ("nominal", nominal_best)):
        r = settle(best)
        print(f"    best share for the {name} speeds {best:.1f}: within 5% after {r['steps_to_within_5pct']} steps; "
              f"afterwards {r['changes']} plan changes, {r['reversals']} direction reversals, "
              f"worst deviation {r['worst_deviation']:.1%}")
    within = settle(measured_best)["steps_to_within_5pct"]
    changes_after = settle(measured_best)
    changes_after["nominal"] = settle(nominal_best)
    best_after = measured_best
    if a.svg:
        chart(adapt_steps, B, a.change_at, B / (k + 1), best_after, k, a.svg)
        print(f"  chart: {a.svg}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rounds": rounds, "equal_fraction": eq, "planner_fraction": pl, "steps_to_within_5pct": within,
                       "after_settling": changes_after, "adaptation": adapt_steps}, f, indent=1)


if __name__ == "__main__":
    main()
