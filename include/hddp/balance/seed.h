// The seed rule: every rank's cost before it has trained a step, which the planner's
// first split comes from. One rule for the Trainer (each rank profiles its own device and
// the costs are exchanged) and for hddp-probe (which profiles every device of the node).
//
//   compute / sample   a timed pass the caller made (the Trainer: 8 samples' forward x 3;
//                      hddp-probe: an MLP training step), stretched by an emulated slowdown
//   link               the profile's (cost_model.h: emulated > measured > nominal PCIe)
//   overlap            a device rank whose loader copies from pinned memory on a side
//                      stream pays max(compute, transfer) per sample, else their sum
//   allreduce          the gradients' ring allreduce over the slowest link: a term no
//                      split changes, predicted once for the log and the metrics
#pragma once

#include <cstdint>
#include <vector>

#include "hddp/balance/batch_plan.h"
#include "hddp/balance/cost_model.h"
#include "hddp/balance/emulation.h"

namespace hddp {

class Communicator;

/// What the caller measured of its rank before the first step.
struct SeedMeasurement {
  /// Compute seconds per sample (forward and backward) of a timed pass; 0 = unknown.
  double computeSecondsPerSample = 0.0;
  /// Whether the loader copies inputs on a side stream from pinned memory (a device rank
  /// with LoaderOptions::pinMemory). Ignored for a CPU rank (no copies).
  bool pinnedSideStreamCopies = true;
};

/// `profile` (device, link, input bytes, memory cap) completed by the seed rule with what
/// was measured and the rank's emulation (slowdown, link).
RankProfile seedProfile(RankProfile profile, const SeedMeasurement& measured,
                        const EmulationOptions& emulation);

/// Every rank's seed cost, by rank: a collective (every rank calls it once, in the same
/// order as its other collectives).
std::vector<RankCost> exchangeSeedCosts(Communicator& comm, const RankCost& mine);

/// The gradients' allreduce as the seed predicts it.
struct AllreducePrediction {
  double gradientBytes = 0.0;
  /// Ring allreduce seconds over the slowest link (ringAllreduceSeconds); 0 = no link term
  /// (one rank, or ranks without a host link).
  double seconds = 0.0;
  double slowestLinkBytesPerSecond = 0.0;
  /// The rank whose link is the slowest; -1 when no rank has a link.
  int slowestRank = -1;
};

/// The allreduce of `gradientBytes` per step among the ranks of `costs` (the seed costs,
/// by rank), over the slowest link any of them has.
AllreducePrediction predictAllreduce(const std::vector<RankCost>& costs, double gradientBytes);

}  // namespace hddp
