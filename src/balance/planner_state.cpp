// BatchPlanner's persistence (hddp/balance/planner.h): its state as a value
// (state/restore), through the Trainer's archives (save/load), and into another number
// of ranks after an elastic re-forming (loadRemapped).
#include <torch/serialize/archive.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "balance/split_with_minimum.h"
#include "hddp/balance/planner.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {

using balance::solveWithMinimum;

BatchPlanner::State BatchPlanner::state() const {
  return State{
      plan_, step_,
      std::vector<RankEstimator::Sample>(estimator_.samples().begin(), estimator_.samples().end()),
      costs_};
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
  estimator_.restore({state.window.begin(), state.window.end()});
  costs_ = state.costs;
  pending_ = {};  // a proposal waiting for confirmation is proposed again if still true
  probing_ = false;
  measured_ = step_ >= firstUpdate() && static_cast<int>(costs_.size()) == comm_.size();
  for (const auto& c : costs_) {
    measured_ = measured_ && c.secondsPerSample > 0;
  }
  HDDP_LOG_SHARED("balance", comm_.rank(), "resumed at step ", step_, " with plan ",
                  plan_.describe());
}

namespace {

at::Tensor doubles(const std::vector<double>& v) {
  return at::tensor(v.empty() ? std::vector<double>{} : v, at::kDouble);
}

// An entry of the type save() writes it in (the file's bytes choose the type: a damaged
// or crafted one is a StateError, not a read of other-typed memory).
at::Tensor readEntry(torch::serialize::InputArchive& archive, const char* key,
                     at::ScalarType type) {
  at::Tensor t;
  HDDP_CHECK_AS(StateError, archive.try_read(key, t), "the planner's state has no '", key,
                "' (written by another program or an incompatible hddp version?)");
  HDDP_CHECK_AS(StateError, t.scalar_type() == type, "the planner's '", key, "' holds ",
                t.scalar_type(), ", not ", type, " (the state file is damaged or not hddp's)");
  return t.contiguous();
}

}  // namespace

void BatchPlanner::save(torch::serialize::OutputArchive& shared,
                        torch::serialize::OutputArchive& own) const {
  shared.write("plan", at::tensor(plan_.local, at::kLong));
  shared.write("step", at::tensor(std::vector<int64_t>{step_}, at::kLong));
  // Per rank: compute s/sample, fixed s, bytes/sample, link B/s, copies overlapped.
  std::vector<double> costs;
  std::vector<int64_t> caps;  // -1 = none
  for (const auto& c : costs_) {
    const auto fields = costFields(c);
    costs.insert(costs.end(), fields.begin(), fields.end());
  }

  for (const auto& c : costs_) {  // given or learned; derived caps are derived again
    caps.push_back(c.maxSamples == std::numeric_limits<int64_t>::max() ? -1 : c.maxSamples);
  }
  shared.write("costs", doubles(costs).reshape({static_cast<int64_t>(costs_.size()),
                                                static_cast<int64_t>(kRankCostFields)}));
  shared.write("caps", at::tensor(caps, at::kLong));
  std::vector<double> window;  // per step: samples, compute s, fixed s, transfer s, bytes
  for (const auto& w : estimator_.samples()) {
    window.insert(window.end(), {w.samples, w.compute, w.fixed, w.transfer, w.bytes});
  }
  own.write("window",
            doubles(window).reshape({static_cast<int64_t>(estimator_.samples().size()), 5}));
}

void BatchPlanner::load(torch::serialize::InputArchive& shared,
                        torch::serialize::InputArchive& own) {
  State state;
  const at::Tensor plan = readEntry(shared, "plan", at::kLong);
  // A file saved by another number of ranks is loadRemapped's: here a count that differs
  // is a damaged file (restore() would call it a ConfigError, a caller's mistake).
  HDDP_CHECK_AS(StateError, plan.numel() == comm_.size(), "the planner's saved plan is for ",
                plan.numel(), " ranks, not ", comm_.size(),
                " (the state file is damaged or not hddp's)");
  state.plan.local.assign(plan.data_ptr<int64_t>(), plan.data_ptr<int64_t>() + plan.numel());
  state.plan.global = options_.globalBatch;
  // Each rank's loader takes its share as a batch size: a share beyond the global batch
  // (one negative beside it) would have it allocate that many samples.
  int64_t sum = 0;
  bool split = true;
  for (const int64_t b : state.plan.local) {
    split = split && b >= 0 && b <= options_.globalBatch;
    sum += split ? b : 0;
  }
  HDDP_CHECK_AS(StateError, split && sum == options_.globalBatch, "the planner's saved plan ",
                c10::IntArrayRef(state.plan.local), " does not split the global batch of ",
                options_.globalBatch, " (the state file is damaged or not hddp's)");
  const at::Tensor step = readEntry(shared, "step", at::kLong);
  HDDP_CHECK_AS(StateError, step.numel() == 1, "the planner's state has a malformed step");
  state.step = step.item<int64_t>();
  const at::Tensor window = readEntry(own, "window", at::kDouble);
  HDDP_CHECK_AS(StateError, window.dim() == 2 && window.size(1) == 5,
                "the planner's measurement window has shape ", window.sizes(),
                ", not [steps, 5] (written by an older hddp?)");
  for (int64_t i = 0; i < window.size(0); ++i) {
    const double* w = window.data_ptr<double>() + 5 * i;
    state.window.push_back(RankEstimator::Sample{w[0], w[1], w[2], w[3], w[4]});
  }
  state.costs = readCosts(shared);
  // save() writes a cost per rank, or none before there is one.
  HDDP_CHECK_AS(StateError,
                state.costs.empty() || static_cast<int>(state.costs.size()) == comm_.size(),
                "the planner's saved costs are for ", state.costs.size(), " ranks, not ",
                comm_.size(), " (the state file is damaged or not hddp's)");
  restore(state);
}

void BatchPlanner::loadRemapped(torch::serialize::InputArchive& shared,
                                torch::serialize::InputArchive* own,
                                const std::vector<int>& fromSaved) {
  HDDP_CHECK_AS(ConfigError, static_cast<int>(fromSaved.size()) == comm_.size(),
                "loadRemapped: a saved rank for each of the ", comm_.size(), " ranks, not ",
                fromSaved.size());
  const std::vector<RankCost> saved = readCosts(shared);
  const at::Tensor step = readEntry(shared, "step", at::kLong);
  HDDP_CHECK_AS(StateError, step.numel() == 1, "the planner's state has a malformed step");
  // A newcomer is costed at the mean of the others (or its seed) until it is measured.
  double perSample = 0;
  double fixed = 0;
  int known = 0;
  for (int from : fromSaved) {
    if (from >= 0 && from < static_cast<int>(saved.size()) &&
        saved[static_cast<size_t>(from)].secondsPerSample > 0) {
      perSample += saved[static_cast<size_t>(from)].secondsPerSample;
      fixed += saved[static_cast<size_t>(from)].fixedSeconds;
      ++known;
    }
  }
  std::vector<RankCost> costs(fromSaved.size());
  bool allKnown = true;
  for (size_t r = 0; r < fromSaved.size(); ++r) {
    const int from = fromSaved[r];
    if (from >= 0 && from < static_cast<int>(saved.size())) {
      costs[r] = saved[static_cast<size_t>(from)];
      continue;
    }
    allKnown = false;
    if (r < costs_.size()) {
      costs[r] = costs_[r];  // the seed (topology, calibration), if there was one
    }
    if (!(costs[r].secondsPerSample > 0) && known > 0) {
      costs[r].secondsPerSample = perSample / known;
      costs[r].fixedSeconds = fixed / known;
    }
  }
  std::vector<RankEstimator::Sample> window;
  if (own) {  // checked as load() checks it
    const at::Tensor w = readEntry(*own, "window", at::kDouble);
    HDDP_CHECK_AS(StateError, w.dim() == 2 && w.size(1) == 5,
                  "the planner's measurement window has shape ", w.sizes(),
                  ", not [steps, 5] (written by an older hddp?)");
    for (int64_t i = 0; i < w.size(0); ++i) {
      const double* v = w.data_ptr<double>() + 5 * i;
      window.push_back(RankEstimator::Sample{v[0], v[1], v[2], v[3], v[4]});
    }
  }
  bool costed = true;
  for (const auto& c : costs) {
    costed = costed && c.secondsPerSample > 0;
  }
  plan_ = costed ? solveWithMinimum(costs, options_.globalBatch, options_.minLocalBatch)
                 : equalSplit(comm_.size(), options_.globalBatch);
  step_ = step.item<int64_t>();
  costs_ = costs;
  estimator_.restore({window.begin(), window.end()});
  measured_ = allKnown && costed && step_ >= firstUpdate();
  HDDP_LOG_SHARED(
      "balance", comm_.rank(), "resumed at step ", step_, " with ", comm_.size(), " ranks (",
      saved.size(), " saved): plan ", plan_.describe(),
      allKnown ? std::string() : std::string(", newcomers measured from the next update"));
}

std::vector<RankCost> BatchPlanner::readCosts(torch::serialize::InputArchive& shared) const {
  std::vector<RankCost> out;
  const at::Tensor costs = readEntry(shared, "costs", at::kDouble);
  HDDP_CHECK_AS(StateError,
                costs.dim() == 2 && costs.size(1) == static_cast<int64_t>(kRankCostFields),
                "the planner's costs have shape ", costs.sizes(),
                ", not [ranks, 5] (written by an older hddp?)");
  for (int64_t i = 0; i < costs.size(0); ++i) {
    out.push_back(
        costFromFields(costs.data_ptr<double>() + static_cast<int64_t>(kRankCostFields) * i));
  }
  const at::Tensor caps = readEntry(shared, "caps", at::kLong);
  // save() writes a cap for each rank it writes costs of.
  HDDP_CHECK_AS(StateError, caps.numel() == costs.size(0), "the planner's state holds ",
                caps.numel(), " memory caps for ", costs.size(0),
                " ranks' costs (the state file is damaged or not hddp's)");
  for (int64_t i = 0; i < caps.numel(); ++i) {
    const int64_t cap = caps.data_ptr<int64_t>()[i];
    if (cap >= 0) {
      out[static_cast<size_t>(i)].maxSamples = cap;
    }
  }
  return out;
}

}  // namespace hddp
