// BatchPlanner (hddp/balance/planner.h): recording, the update at the end of each step
// (the exchange, then the rule), probes and memory caps. The rule itself (choose,
// decide; pure) is in planner_rule.cpp, persistence in planner_state.cpp.
#include "hddp/balance/planner.h"

#include <torch/serialize/archive.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>

#include "balance/split_with_minimum.h"
#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {
namespace {

using balance::solveWithMinimum;

std::string describeCaps(const std::vector<int64_t>& caps) {
  std::string text = "[";
  for (size_t r = 0; r < caps.size(); ++r) {
    text += (r ? ", " : "");
    text += caps[r] == std::numeric_limits<int64_t>::max() ? "none" : std::to_string(caps[r]);
  }
  return text + "]";
}

// "rank 0: 1.2 ms/sample +-3%, fixed 0.4 ms, link 2.8 GB/s; rank 1: ..."
std::string describeCosts(const std::vector<RankCost>& costs, const std::vector<double>& errors) {
  std::ostringstream os;
  os.precision(3);
  for (size_t r = 0; r < costs.size(); ++r) {
    const RankCost& c = costs[r];
    os << (r ? "; " : "") << "rank " << r << ": " << c.secondsPerSample * 1e3 << " ms/sample";
    if (r < errors.size()) {
      os << " +-" << errors[r] * 100 << "%";
    }
    os << ", fixed " << c.fixedSeconds * 1e3 << " ms";
    if (c.linkBytesPerSecond > 0 && c.bytesPerSample > 0) {
      os << ", input " << c.transferSecondsPerSample() * 1e3 << " ms/sample over "
         << c.linkBytesPerSecond / 1e9 << " GB/s" << (c.transferOverlapped ? " (overlapped)" : "");
    }
  }
  return os.str();
}

}  // namespace

BatchPlanner::BatchPlanner(Communicator& communicator, PlannerOptions options,
                           std::vector<RankCost> initial)
    : comm_(communicator),
      options_(options),
      costs_(std::move(initial)),
      estimator_(std::max(options.window, 1), std::max(options.confidence, 0.0),
                 std::max(1, std::min(options.rebalanceEvery, options.window / 2))),
      memory_(std::max(options.window, 1)),
      derivedCaps_(static_cast<size_t>(communicator.size()), std::numeric_limits<int64_t>::max()) {
  HDDP_CHECK_AS(ConfigError,
                options_.globalBatch >= comm_.size() * std::max<int64_t>(options_.minLocalBatch, 0),
                "global batch ", options_.globalBatch, " is too small for ", comm_.size(),
                " ranks");
  HDDP_CHECK_AS(ConfigError,
                options_.rebalanceEvery >= 1 && options_.window >= 1 && options_.hysteresis >= 0 &&
                    options_.confidence >= 0,
                "PlannerOptions: rebalanceEvery ", options_.rebalanceEvery, ", window ",
                options_.window, ", hysteresis ", options_.hysteresis, ", confidence ",
                options_.confidence, " must be positive");
  HDDP_CHECK_AS(ConfigError, options_.memoryHeadroom >= 0 && options_.memoryHeadroom < 1,
                "PlannerOptions: memoryHeadroom ", options_.memoryHeadroom,
                " is the fraction of a device's memory kept free, from 0 to below 1");
  if (costs_.empty()) {
    plan_ = equalSplit(comm_.size(), options_.globalBatch);
    if (options_.minLocalBatch > 0) {
      for (auto b : plan_.local) {
        HDDP_CHECK_AS(ConfigError, b >= options_.minLocalBatch,
                      "equal split below the minimum share");
      }
    }
  } else {
    HDDP_CHECK_AS(ConfigError, static_cast<int>(costs_.size()) == comm_.size(),
                  "initial costs for ", costs_.size(), " ranks in a group of ", comm_.size());
    plan_ = solveWithMinimum(costs_, options_.globalBatch, options_.minLocalBatch);
  }
  HDDP_LOG_SHARED("balance", comm_.rank(), "initial plan ", plan_.describe());
}

void BatchPlanner::record(int64_t samples, double computeSeconds) {
  StepMeasurement m;
  m.samples = samples;
  m.computeSeconds = computeSeconds;
  record(m);
}

void BatchPlanner::record(const StepMeasurement& measurement) { estimator_.record(measurement); }

BatchPlan BatchPlanner::withProbes(const BatchPlan& plan) const {
  BatchPlan probed = plan;
  for (size_t r = 0; r < probed.local.size() && r < costs_.size(); ++r) {
    if (probed.local[r] != 0 || costs_[r].maxSamples < 1 || !(costs_[r].secondsPerSample > 0) ||
        costs_[r].predict(1) > 2.0 * plan.predictedStepSeconds) {
      continue;
    }
    const auto donor = std::max_element(probed.local.begin(), probed.local.end());
    if (*donor <= std::max<int64_t>(1, options_.minLocalBatch)) {
      continue;
    }
    --*donor;
    probed.local[r] = 1;
  }
  return probed;
}

int64_t BatchPlanner::firstUpdate() const {
  return options_.calibrationSteps > 0 ? options_.calibrationSteps : options_.rebalanceEvery;
}

bool BatchPlanner::endStep() {
  ++step_;
  lastExchangeSeconds_ = 0.0;
  const int64_t first = firstUpdate();
  if (step_ < first || (step_ - first) % options_.rebalanceEvery != 0) {
    return false;
  }
  // This rank's estimate, exchanged as doubles: compute seconds per sample, its
  // relative standard error, fixed seconds, transfer seconds per sample, bytes per
  // sample, and the memory cap derived from its measured memory (-1: none).
  const RankEstimator::Estimate own = estimator_.estimate();
  const int64_t ownCap = memory_.cap(options_.memoryHeadroom);
  // What every rank tells the others: its estimate and its derived cap (-1: none). No
  // padding, so that every byte sent is a field's.
  struct Shared {
    double secondsPerSample;
    double relativeError;
    double fixedSeconds;
    double transferSecondsPerSample;
    double bytesPerSample;
    int64_t cap;
  };
  static_assert(sizeof(Shared) == 6 * 8, "Shared must have no padding");
  const Shared mine{
      own.secondsPerSample, own.relativeError,
      own.fixedSeconds,     own.transferSecondsPerSample,
      own.bytesPerSample,   ownCap == std::numeric_limits<int64_t>::max() ? -1 : ownCap};
  const auto exchangeStart = std::chrono::steady_clock::now();
  const std::vector<Shared> all = allgatherValue(comm_, mine);
  lastExchangeSeconds_ =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - exchangeStart).count();
  std::vector<RankEstimator::Estimate> estimates(all.size());
  std::vector<int64_t> derived(all.size(), std::numeric_limits<int64_t>::max());
  for (size_t r = 0; r < all.size(); ++r) {
    estimates[r].secondsPerSample = all[r].secondsPerSample;
    estimates[r].relativeError = all[r].relativeError;
    estimates[r].fixedSeconds = all[r].fixedSeconds;
    estimates[r].transferSecondsPerSample = all[r].transferSecondsPerSample;
    estimates[r].bytesPerSample = all[r].bytesPerSample;
    if (all[r].cap >= 0) {
      derived[r] = all[r].cap;
    }
  }
  bool moved = false;  // a cap appeared, went, or moved by more than 5%
  for (size_t r = 0; r < derived.size(); ++r) {
    const int64_t was = r < derivedCaps_.size() ? derivedCaps_[r] : derived[r];
    constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
    moved = moved || ((was == kNone) != (derived[r] == kNone)) ||
            (was != kNone && std::abs(static_cast<double>(derived[r] - was)) >
                                 0.05 * static_cast<double>(std::max<int64_t>(was, 1)));
  }
  if (moved) {
    HDDP_LOG_SHARED("balance", comm_.rank(), "step ", step_,
                    ": memory caps derived from measured memory ", describeCaps(derived), " (",
                    options_.memoryHeadroom * 100, "% of each device kept free)");
    HDDP_LOG_DEBUG("balance", "rank ", comm_.rank(),
                   "'s memory: ", MemoryEstimator::describe(memory_.fit()));
  }
  derivedCaps_ = derived;
  if (costs_.size() != all.size()) {
    costs_.resize(all.size());
  }
  std::vector<int64_t> hard;
  for (const auto& c : costs_) {
    hard.push_back(c.maxSamples);
  }
  // After a probe the solver's split is adopted outright, as at the calibration: the
  // probe's one sample was an experiment, not a choice to defend.
  Decision d =
      decide(estimates, withDerivedCaps(costs_), plan_, options_, !measured_ || probing_, pending_);
  pending_ = d.proposal;
  probing_ = false;
  for (size_t r = 0; r < d.costs.size() && r < hard.size(); ++r) {
    d.costs[r].maxSamples = hard[r];  // the derived caps are re-derived at each update
  }
  measured_ = measured_ || d.calibrated;
  costs_ = d.costs;
  BatchPlan next = d.plan;
  const std::vector<double>& errors = d.errors;
  const int64_t update = (step_ - first) / options_.rebalanceEvery;  // 0, 1, 2, ...
  if (options_.probeEvery > 0 && measured_ &&
      update % options_.probeEvery == options_.probeEvery - 1) {
    const BatchPlan probed = withProbes(next);
    if (probed.local != next.local) {
      HDDP_LOG_SHARED("balance", comm_.rank(), "step ", step_,
                      ": probing the rank(s) at 0 "
                      "samples with 1 sample each for ",
                      options_.rebalanceEvery, " steps (every ", options_.probeEvery,
                      " updates): plan ", probed.describe());
      next = probed;
      next.predictedStepSeconds = predictedSeconds(costs_, next.local);
      probing_ = true;
    }
  }
  const bool changed = next.local != plan_.local;
  if (changed && !probing_) {
    HDDP_LOG_SHARED("balance", comm_.rank(), "step ", step_, ": plan ", plan_.describe(), " -> ",
                    next.describe(), " (predicted step ", next.predictedStepSeconds, " s; ",
                    describeCosts(costs_, errors), ")");
  }
  plan_ = next;
  return changed;
}

bool BatchPlanner::setMemoryCap(int rank, int64_t maxSamples) {
  const int n = comm_.size();
  HDDP_CHECK_AS(ConfigError, rank >= 0 && rank < n, "setMemoryCap: rank ", rank,
                " is not in a group of ", n);
  HDDP_CHECK_AS(ConfigError, maxSamples >= 0, "setMemoryCap: a memory cap of ", maxSamples,
                " samples for rank ", rank, " is negative");
  if (costs_.size() != static_cast<size_t>(n)) {
    costs_.resize(static_cast<size_t>(n));
  }
  costs_[static_cast<size_t>(rank)].maxSamples = maxSamples;
  // Plan from the last estimates; ranks not measured yet count as equally fast.
  std::vector<RankCost> planning = withDerivedCaps(costs_);
  bool measured = true;
  for (const auto& c : planning) {
    measured = measured && c.secondsPerSample > 0;
  }
  if (!measured) {
    for (auto& c : planning) {
      c.secondsPerSample = 1.0;
      c.fixedSeconds = 0.0;
      c.bytesPerSample = 0.0;
    }
  }
  HDDP_CHECK_AS(ConfigError, maxSamples >= options_.minLocalBatch, "rank ", rank, " can hold only ",
                maxSamples, " samples, below the minimum share of ", options_.minLocalBatch,
                " per rank (SyncBatchNorm needs a sample on every rank)");
  int64_t capacity = 0;
  bool unlimited = false;
  for (const auto& c : planning) {
    if (c.maxSamples == std::numeric_limits<int64_t>::max()) {
      unlimited = true;
      break;
    }
    capacity += c.maxSamples;
  }
  HDDP_CHECK_AS(ConfigError, unlimited || capacity >= options_.globalBatch,
                "the ranks' memory caps ", describeCaps(memoryCaps()), " hold ", capacity,
                " samples in all, fewer than the global batch ", options_.globalBatch,
                ": lower the global batch, or save memory (AMP, activation checkpointing)");
  bool withinCaps = plan_.local.size() == planning.size();
  for (size_t r = 0; r < planning.size() && withinCaps; ++r) {
    withinCaps = plan_.local[r] <= planning[r].maxSamples;
  }
  if (withinCaps && measured_) {
    return false;  // a measured plan that respects every cap stands
  }
  BatchPlan next = solveWithMinimum(planning, options_.globalBatch, options_.minLocalBatch);
  if (measured) {
    next.predictedStepSeconds = predictedSeconds(costs_, next.local);
  }
  const bool changed = next.local != plan_.local;
  if (changed) {
    // The step it applies to (1-based, as the Trainer's metrics and warnings count).
    HDDP_LOG_SHARED("balance", comm_.rank(), "step ", step_ + 1, ": rank ", rank, " capped at ",
                    maxSamples, " samples; plan ", plan_.describe(), " -> ", next.describe());
  }
  plan_ = next;
  return changed;
}

std::vector<int64_t> BatchPlanner::memoryCaps() const {
  std::vector<int64_t> caps(static_cast<size_t>(comm_.size()), std::numeric_limits<int64_t>::max());
  for (size_t r = 0; r < costs_.size() && r < caps.size(); ++r) {
    caps[r] = costs_[r].maxSamples;
  }
  if (!derivedCapsDropped_) {
    for (size_t r = 0; r < caps.size() && r < derivedCaps_.size(); ++r) {
      caps[r] = std::min(caps[r], derivedCaps_[r]);
    }
  }
  return caps;
}

void BatchPlanner::recordMemory(const MemoryObservation& observation) {
  memory_.record(observation);
}

std::vector<RankCost> BatchPlanner::withDerivedCaps(std::vector<RankCost> costs) {
  int64_t capacity = 0;
  bool unlimited = false;
  std::vector<RankCost> capped = costs;
  for (size_t r = 0; r < capped.size(); ++r) {
    if (r < derivedCaps_.size()) {
      capped[r].maxSamples = std::min(capped[r].maxSamples, derivedCaps_[r]);
    }
    const int64_t cap = capped[r].maxSamples;
    if (cap == std::numeric_limits<int64_t>::max()) {
      unlimited = true;
    } else {
      capacity += std::max<int64_t>(0, cap - options_.minLocalBatch);
    }
  }
  const int64_t needed =
      options_.globalBatch - options_.minLocalBatch * static_cast<int64_t>(capped.size());
  if (unlimited || capacity >= needed) {
    derivedCapsDropped_ = false;
    return capped;
  }
  if (!derivedCapsDropped_) {
    HDDP_LOG_WARN("balance", "step ", step_, ": the memory caps derived from measured memory ",
                  describeCaps(derivedCaps_), " hold fewer samples than the global batch ",
                  options_.globalBatch, ": planning without them (the ranks run beyond ",
                  options_.memoryHeadroom * 100,
                  "% headroom; an out-of-memory error would still teach a cap). Lower the "
                  "global batch or save memory (AMP, activation checkpointing)");
  }
  derivedCapsDropped_ = true;
  return costs;
}

}  // namespace hddp
