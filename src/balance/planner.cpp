#include "hddp/balance/planner.h"

#include <algorithm>
#include <cstring>

#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The split with every rank given at least `minLocal`: solve for the rest.
BatchPlan solveWithMinimum(const std::vector<RankCost>& costs, int64_t global, int64_t minLocal) {
  if (minLocal <= 0) {
    return solveSplit(costs, global);
  }
  const auto n = static_cast<int64_t>(costs.size());
  HDDP_CHECK_AS(ConfigError, minLocal * n <= global, "a minimum of ", minLocal,
                " samples on each of ", n, " ranks exceeds the global batch ", global);
  std::vector<RankCost> shifted = costs;
  for (auto& c : shifted) {
    c.fixedSeconds += static_cast<double>(minLocal) * c.perSampleSeconds();
    c.maxSamples = c.maxSamples == std::numeric_limits<int64_t>::max() ? c.maxSamples
                                                                       : c.maxSamples - minLocal;
  }
  BatchPlan plan = solveSplit(shifted, global - minLocal * n);
  for (auto& b : plan.local) {
    b += minLocal;
  }
  plan.global = global;
  plan.predictedStepSeconds = predictedSeconds(costs, plan.local);
  return plan;
}

}  // namespace

BatchPlanner::BatchPlanner(Communicator& communicator, PlannerOptions options,
                           std::vector<RankCost> initial)
    : comm_(communicator), options_(options), costs_(std::move(initial)) {
  HDDP_CHECK_AS(ConfigError,
                options_.globalBatch >= comm_.size() * std::max<int64_t>(options_.minLocalBatch, 0),
                "global batch ", options_.globalBatch, " is too small for ", comm_.size(),
                " ranks");
  HDDP_CHECK_AS(ConfigError,
                options_.rebalanceEvery >= 1 && options_.window >= 1 && options_.hysteresis >= 0,
                "PlannerOptions: rebalanceEvery ", options_.rebalanceEvery, ", window ",
                options_.window, ", hysteresis ", options_.hysteresis, " must be positive");
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
  HDDP_LOG_INFO("balance", "initial plan ", plan_.describe());
}

void BatchPlanner::record(int64_t samples, double computeSeconds) {
  if (samples <= 0 || !(computeSeconds > 0)) {
    return;  // no samples this step: nothing learnt about the speed
  }
  secondsPerSample_.push_back(computeSeconds / static_cast<double>(samples));
  while (static_cast<int>(secondsPerSample_.size()) > options_.window) {
    secondsPerSample_.pop_front();
  }
}

BatchPlan BatchPlanner::choose(const std::vector<RankCost>& estimates, const BatchPlan& current,
                               const PlannerOptions& options) {
  for (const auto& c : estimates) {
    if (!(c.secondsPerSample > 0)) {
      return current;  // some rank has not measured yet
    }
  }
  BatchPlan candidate = solveWithMinimum(estimates, options.globalBatch, options.minLocalBatch);
  const double now = predictedSeconds(estimates, current.local);
  if (candidate.local != current.local &&
      candidate.predictedStepSeconds < now * (1.0 - options.hysteresis)) {
    return candidate;
  }
  BatchPlan kept = current;
  kept.predictedStepSeconds = now;
  return kept;
}

bool BatchPlanner::endStep() {
  ++step_;
  const int64_t first =
      options_.calibrationSteps > 0 ? options_.calibrationSteps : options_.rebalanceEvery;
  if (step_ < first || (step_ - first) % options_.rebalanceEvery != 0) {
    return false;
  }
  const double mine = secondsPerSample_.empty()
                          ? 0.0
                          : median({secondsPerSample_.begin(), secondsPerSample_.end()});
  std::vector<uint8_t> bytes(sizeof(double));
  std::memcpy(bytes.data(), &mine, sizeof(double));
  const auto all = comm_.allgatherBytes(bytes);
  std::vector<RankCost> estimates(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    HDDP_INTERNAL_ASSERT(all[r].size() == sizeof(double), "bad estimate from rank ", r);
    std::memcpy(&estimates[r].secondsPerSample, all[r].data(), sizeof(double));
    if (r < costs_.size()) {
      estimates[r].maxSamples = costs_[r].maxSamples;  // memory caps are not measured here
    }
  }
  costs_ = estimates;
  BatchPlan next = choose(estimates, plan_, options_);
  const bool changed = next.local != plan_.local;
  if (changed) {
    HDDP_LOG_INFO("balance", "step ", step_, ": plan ", plan_.describe(), " -> ", next.describe(),
                  " (predicted step ", next.predictedStepSeconds, " s)");
  }
  plan_ = next;
  return changed;
}

}  // namespace hddp
