// The planner's split with a minimum share per rank (internal to the balance layer;
// used by the planning rule and by the planner's persistence).
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "hddp/balance/batch_plan.h"
#include "hddp/core/error.h"

namespace hddp {
namespace balance {

// The split with every rank given at least `minLocal`: solve for the rest.
inline BatchPlan solveWithMinimum(const std::vector<RankCost>& costs, int64_t global,
                                  int64_t minLocal) {
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

}  // namespace balance
}  // namespace hddp
