// Recovery from a rank running out of device memory in a step (internal to the train
// layer): every rank learns who failed at which share, the failing ranks' memory caps
// are set below it, and the planner re-splits the batch so the step can be repeated.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hddp/balance/batch_plan.h"

namespace hddp {

class BatchPlanner;
class Communicator;

namespace train {

struct OutOfMemoryFailure {
  int rank = 0;
  int64_t localBatch = 0;  // the share it failed at
};

struct OutOfMemoryRecovery {
  std::vector<OutOfMemoryFailure> failures;
  BatchPlan before;
  BatchPlan after;
  /// "step 12: out of memory on rank 1 at 40 samples (...); memory cap learned, split
  /// [..] -> [..]; the step is repeated"
  std::string message;
};

/// After a step some rank abandoned (collective: every rank calls it, with this rank's
/// allocation error, "" when it had none, and its share): gathers the failures, caps
/// each failing rank 10% below the share that failed (at least `minLocalBatch`, at least
/// 1) and re-plans. Throws hddp::Error with what to do when balancing is off (`planner`
/// null) or a rank failed at the smallest share. `step` is the 1-based step for the
/// message.
OutOfMemoryRecovery recoverFromOutOfMemory(Communicator& comm, BatchPlanner* planner,
                                           const std::string& mine, int64_t localBatch,
                                           int64_t minLocalBatch, int64_t step);

}  // namespace train
}  // namespace hddp
