// BatchPlanner's planning rule (hddp/balance/planner.h): which split a set of costs asks
// for (choose) and whether the ranks adopt it (decide). Pure functions of their
// arguments, so that every rank derives the same plan from the same exchanged numbers,
// and tests call them directly.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "balance/split_with_minimum.h"
#include "hddp/balance/planner.h"
#include "hddp/core/error.h"

namespace hddp {

using balance::solveWithMinimum;

BatchPlan BatchPlanner::choose(const std::vector<RankCost>& estimates, const BatchPlan& current,
                               const PlannerOptions& options,
                               const std::vector<double>& relativeErrors) {
  for (const auto& c : estimates) {
    if (!(c.secondsPerSample > 0)) {
      return current;  // some rank has not measured yet
    }
  }
  BatchPlan candidate = solveWithMinimum(estimates, options.globalBatch, options.minLocalBatch);
  bool breaksCap = current.local.size() != estimates.size();
  for (size_t r = 0; r < estimates.size() && !breaksCap; ++r) {
    breaksCap = current.local[r] > estimates[r].maxSamples;
  }
  if (breaksCap) {
    return candidate;
  }
  const double now = predictedSeconds(estimates, current.local);
  BatchPlan kept = current;
  kept.predictedStepSeconds = now;
  const double gain = now - candidate.predictedStepSeconds;
  if (candidate.local == current.local || !(gain > options.hysteresis * now)) {
    return kept;
  }
  if (options.confidence > 0 && relativeErrors.size() == estimates.size()) {
    // The standard error of the gain: the slowest rank's predicted time under each plan
    // carries its estimate's error; taken as independent even when one rank is the
    // slowest under both (whether it really is the slowest is what the noise puts in
    // doubt), which errs on the side of keeping the plan.
    auto slowest = [&](const std::vector<int64_t>& local) {
      size_t worst = 0;
      for (size_t r = 1; r < estimates.size(); ++r) {
        if (estimates[r].predict(local[r]) > estimates[worst].predict(local[worst])) {
          worst = r;
        }
      }
      return worst;
    };
    const size_t a = slowest(current.local);
    const size_t k = slowest(candidate.local);
    auto error = [&](size_t r, double samples) {
      return relativeErrors[r] * estimates[r].perSampleSeconds() * samples;
    };
    const double sd = std::hypot(error(a, static_cast<double>(current.local[a])),
                                 error(k, static_cast<double>(candidate.local[k])));
    if (!(gain > options.confidence * sd)) {
      return kept;
    }
  }
  return candidate;
}

namespace {

// Whether `b` moves every rank the same way from `current` as `a` does.
bool sameMove(const std::vector<int64_t>& a, const std::vector<int64_t>& b,
              const std::vector<int64_t>& current) {
  if (a.size() != current.size() || b.size() != current.size()) {
    return false;
  }
  auto sign = [](int64_t v) { return (v > 0) - (v < 0); };
  for (size_t r = 0; r < current.size(); ++r) {
    if (sign(a[r] - current[r]) != sign(b[r] - current[r])) {
      return false;
    }
  }
  return true;
}

}  // namespace

BatchPlanner::Decision BatchPlanner::decide(const std::vector<RankEstimator::Estimate>& estimates,
                                            const std::vector<RankCost>& previous,
                                            const BatchPlan& current, const PlannerOptions& options,
                                            bool calibrating, const Proposal& pending) {
  Decision d;
  d.costs.resize(estimates.size());
  d.errors.resize(estimates.size());
  bool allMeasured = true;
  for (size_t r = 0; r < estimates.size(); ++r) {
    const RankEstimator::Estimate& e = estimates[r];
    // What is not measured (the link, whether copies overlap, the memory cap) stays as
    // the seed or the last update had it.
    // A rank that has measured nothing (a share of 0 since the start) keeps its seed or
    // last cost: overwriting it with 0 would stop every later plan (choose() keeps the
    // plan while a cost is unknown).
    RankCost c = r < previous.size() ? previous[r] : RankCost{};
    if (e.secondsPerSample > 0) {
      c.secondsPerSample = e.secondsPerSample;
      c.fixedSeconds = e.fixedSeconds;
    }
    if (e.transferSecondsPerSample > 0) {
      // Measured transfer: the link's effective bandwidth for this rank's input.
      if (e.bytesPerSample > 0) {
        c.bytesPerSample = e.bytesPerSample;
      } else if (!(c.bytesPerSample > 0)) {
        c.bytesPerSample = 1.0;
      }
      c.linkBytesPerSecond = c.bytesPerSample / e.transferSecondsPerSample;
    }
    d.costs[r] = c;
    d.errors[r] = e.relativeError;
    // Every rank with samples has measured; one without keeps a known cost.
    const bool hasSamples = r < current.local.size() && current.local[r] > 0;
    allMeasured = allMeasured && c.secondsPerSample > 0 && (!hasSamples || e.secondsPerSample > 0);
  }
  if (calibrating && allMeasured) {
    // The first plan from measurements (the calibration): the plan it replaces was a
    // guess (equal split or topology), not a measured choice, so neither hysteresis nor
    // the noise of a short, cold window holds it back.
    PlannerOptions calibration = options;
    calibration.hysteresis = 0.0;
    calibration.confidence = 0.0;
    d.plan = choose(d.costs, current, calibration);
    d.calibrated = true;
  } else {
    d.plan = choose(d.costs, current, options, d.errors);
    bool breaksCap = current.local.size() != d.costs.size();
    for (size_t r = 0; r < d.costs.size() && !breaksCap; ++r) {
      breaksCap = current.local[r] > d.costs[r].maxSamples;
    }
    if (d.plan.local != current.local && !breaksCap && options.confirmations > 1) {
      const double now = predictedSeconds(d.costs, current.local);
      const double gain = now - d.plan.predictedStepSeconds;
      if (!(gain >= options.decisiveGain * now)) {
        // A modest gain: adopted once consecutive updates propose the same move.
        const int count =
            sameMove(pending.local, d.plan.local, current.local) ? pending.count + 1 : 1;
        if (count < options.confirmations) {
          d.proposal = Proposal{d.plan.local, count};
          d.plan = current;
          d.plan.predictedStepSeconds = now;
        }
      }
    }
  }
  return d;
}

}  // namespace hddp
