#include "hddp/balance/planner.h"

#include <torch/serialize/archive.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {
namespace {

std::string describeCaps(const std::vector<int64_t>& caps) {
  std::string text = "[";
  for (size_t r = 0; r < caps.size(); ++r) {
    text += (r ? ", " : "");
    text += caps[r] == std::numeric_limits<int64_t>::max() ? "none" : std::to_string(caps[r]);
  }
  return text + "]";
}

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
                               const PlannerOptions& options,
                               const std::vector<double>& relativeNoise) {
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
  double threshold = options.hysteresis;
  for (double noise : relativeNoise) {
    threshold = std::max(threshold, options.noiseMultiplier * noise);
  }
  if (candidate.local != current.local &&
      candidate.predictedStepSeconds < now * (1.0 - threshold)) {
    return candidate;
  }
  BatchPlan kept = current;
  kept.predictedStepSeconds = now;
  return kept;
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
  // This rank's estimate (median seconds per sample) and its relative noise (median
  // absolute deviation over the median), exchanged as two doubles.
  double mine[2] = {0.0, 0.0};
  if (!secondsPerSample_.empty()) {
    std::vector<double> window(secondsPerSample_.begin(), secondsPerSample_.end());
    mine[0] = median(window);
    std::vector<double> deviation;
    for (double v : window) {
      deviation.push_back(std::abs(v - mine[0]));
    }
    mine[1] = mine[0] > 0 ? median(deviation) / mine[0] : 0.0;
  }
  std::vector<uint8_t> bytes(sizeof(mine));
  std::memcpy(bytes.data(), mine, sizeof(mine));
  const auto exchangeStart = std::chrono::steady_clock::now();
  const auto all = comm_.allgatherBytes(bytes);
  lastExchangeSeconds_ =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - exchangeStart).count();
  std::vector<RankCost> estimates(all.size());
  std::vector<double> noise(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    HDDP_INTERNAL_ASSERT(all[r].size() == sizeof(mine), "bad estimate from rank ", r);
    double theirs[2];
    std::memcpy(theirs, all[r].data(), sizeof(theirs));
    estimates[r].secondsPerSample = theirs[0];
    noise[r] = theirs[1];
    if (r < costs_.size()) {
      estimates[r].maxSamples = costs_[r].maxSamples;  // memory caps are not measured here
    }
  }
  costs_ = estimates;
  bool allMeasured = true;
  for (const auto& c : estimates) {
    allMeasured = allMeasured && c.secondsPerSample > 0;
  }
  BatchPlan next;
  if (!measured_ && allMeasured) {
    // The first plan from measurements (the calibration): the plan it replaces was a
    // guess (equal split or topology), not a measured choice, so neither hysteresis nor
    // the noise of a short, cold window holds it back.
    PlannerOptions calibration = options_;
    calibration.hysteresis = 0.0;
    calibration.noiseMultiplier = 0.0;
    next = choose(estimates, plan_, calibration);
    measured_ = true;
  } else {
    next = choose(estimates, plan_, options_, noise);
  }
  const bool changed = next.local != plan_.local;
  if (changed) {
    HDDP_LOG_INFO("balance", "step ", step_, ": plan ", plan_.describe(), " -> ", next.describe(),
                  " (predicted step ", next.predictedStepSeconds, " s)");
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
  std::vector<RankCost> planning = costs_;
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
  BatchPlan next = solveWithMinimum(planning, options_.globalBatch, options_.minLocalBatch);
  if (measured) {
    next.predictedStepSeconds = predictedSeconds(costs_, next.local);
  }
  const bool changed = next.local != plan_.local;
  if (changed) {
    HDDP_LOG_INFO("balance", "step ", step_, ": rank ", rank, " capped at ", maxSamples,
                  " samples; plan ", plan_.describe(), " -> ", next.describe());
  }
  plan_ = next;
  return changed;
}

std::vector<int64_t> BatchPlanner::memoryCaps() const {
  std::vector<int64_t> caps(static_cast<size_t>(comm_.size()), std::numeric_limits<int64_t>::max());
  for (size_t r = 0; r < costs_.size() && r < caps.size(); ++r) {
    caps[r] = costs_[r].maxSamples;
  }
  return caps;
}

BatchPlanner::State BatchPlanner::state() const {
  return State{plan_, step_,
               std::vector<double>(secondsPerSample_.begin(), secondsPerSample_.end()), costs_};
}

void BatchPlanner::restore(const State& state) {
  HDDP_CHECK_AS(ConfigError, static_cast<int>(state.plan.local.size()) == comm_.size(),
                "planner state saved for ", state.plan.local.size(), " ranks cannot resume with ",
                comm_.size(), " ranks");
  HDDP_CHECK_AS(ConfigError, state.plan.global == options_.globalBatch,
                "planner state saved with global batch ", state.plan.global,
                " cannot resume with global batch ", options_.globalBatch);
  plan_ = state.plan;
  step_ = state.step;
  secondsPerSample_.assign(state.window.begin(), state.window.end());
  while (static_cast<int>(secondsPerSample_.size()) > options_.window) {
    secondsPerSample_.pop_front();
  }
  costs_ = state.costs;
  measured_ = step_ >= firstUpdate() && static_cast<int>(costs_.size()) == comm_.size();
  for (const auto& c : costs_) {
    measured_ = measured_ && c.secondsPerSample > 0;
  }
  HDDP_LOG_INFO("balance", "resumed at step ", step_, " with plan ", plan_.describe());
}

namespace {

at::Tensor doubles(const std::vector<double>& v) {
  return at::tensor(v.empty() ? std::vector<double>{} : v, at::kDouble);
}

at::Tensor readEntry(torch::serialize::InputArchive& archive, const char* key) {
  at::Tensor t;
  HDDP_CHECK_AS(StateError, archive.try_read(key, t), "the planner's state has no '", key,
                "' (written by another program or an incompatible hddp version?)");
  return t.contiguous();
}

}  // namespace

void BatchPlanner::save(torch::serialize::OutputArchive& shared,
                        torch::serialize::OutputArchive& own) const {
  shared.write("plan", at::tensor(plan_.local, at::kLong));
  shared.write("step", at::tensor(std::vector<int64_t>{step_}, at::kLong));
  std::vector<double> costs;
  std::vector<int64_t> caps;  // -1 = none
  for (const auto& c : costs_) {
    costs.push_back(c.secondsPerSample);
  }
  for (int64_t cap : memoryCaps()) {
    caps.push_back(cap == std::numeric_limits<int64_t>::max() ? -1 : cap);
  }
  shared.write("costs", doubles(costs));
  shared.write("caps", at::tensor(caps, at::kLong));
  own.write("window", doubles({secondsPerSample_.begin(), secondsPerSample_.end()}));
}

void BatchPlanner::load(torch::serialize::InputArchive& shared,
                        torch::serialize::InputArchive& own) {
  State state;
  const at::Tensor plan = readEntry(shared, "plan");
  state.plan.local.assign(plan.data_ptr<int64_t>(), plan.data_ptr<int64_t>() + plan.numel());
  state.plan.global = options_.globalBatch;
  const at::Tensor step = readEntry(shared, "step");
  HDDP_CHECK_AS(StateError, step.numel() == 1, "the planner's state has a malformed step");
  state.step = step.item<int64_t>();
  const at::Tensor window = readEntry(own, "window");
  state.window.assign(window.data_ptr<double>(), window.data_ptr<double>() + window.numel());
  const at::Tensor costs = readEntry(shared, "costs");
  for (int64_t i = 0; i < costs.numel(); ++i) {
    RankCost c;
    c.secondsPerSample = costs.data_ptr<double>()[i];
    state.costs.push_back(c);
  }
  const at::Tensor caps = readEntry(shared, "caps");
  if (caps.numel() == comm_.size()) {
    state.costs.resize(static_cast<size_t>(comm_.size()));
    for (int64_t i = 0; i < caps.numel(); ++i) {
      const int64_t cap = caps.data_ptr<int64_t>()[i];
      if (cap >= 0) {
        state.costs[static_cast<size_t>(i)].maxSamples = cap;
      }
    }
  }
  restore(state);
}

}  // namespace hddp
