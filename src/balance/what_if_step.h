// What-if's step model (src/balance/what_if.cpp): a split's step with its allreduce and
// what of it backward hides, the traffic the gradients put on the slowest link, and the
// compression WhatIfSettings::compression chooses. Internal to the balance layer.
#pragma once

#include <cstdint>
#include <vector>

#include "hddp/balance/batch_plan.h"
#include "hddp/balance/what_if.h"

namespace hddp {
namespace what_if_detail {

// One step of a set of costs: the split, the allreduce and what of it backward hides.
struct Step {
  BatchPlan plan;
  double allreduce = 0.0;
  double exposed = 0.0;
  double backward = 0.0;  // the slowest rank's, which the buckets go out during
  double slowestLinkBytesPerSecond = 0.0;
  double seconds = 0.0;
};

// What the gradients put on the slowest link per step: the bytes, the share of them in
// the last bucket (it cannot hide behind backward), and the compression's own compute.
struct Traffic {
  double wireBytes = 0.0;
  double lastShare = 1.0;
  double endShare = 0.0;  // sent only after backward (PowerSGD's Q round)
  double computeSeconds = 0.0;
};

// The plain allreduce of `parameterBytes`: every byte on the wire, and the share of them in
// the last bucket by the settings' bucket sizes.
Traffic plainTraffic(double parameterBytes, const WhatIfSettings& s);

// The step of `costs` with the split `local` and `traffic` on the slowest link.
Step stepFor(const std::vector<RankCost>& costs, const std::vector<int64_t>& local,
             const Traffic& traffic, const WhatIfSettings& settings);

// stepFor with the planner's split of `globalBatch`.
Step solvedStep(const std::vector<RankCost>& costs, int64_t globalBatch, const Traffic& traffic,
                const WhatIfSettings& settings);

// The whole batch on one device, in micro-batches its memory holds (accumulation).
double aloneSamplesPerSecond(const RankCost& c, int64_t globalBatch);

// What WhatIfSettings::compression sends, priced on the mix (for "auto", each candidate
// priced and chosen as the Trainer does); the choice is recorded in `r`.
Traffic chooseTraffic(const std::vector<MixEntry>& mix, const std::vector<RankCost>& costs,
                      const ModelProfile& p, const WhatIfSettings& s, WhatIfResult& r);

}  // namespace what_if_detail
}  // namespace hddp
