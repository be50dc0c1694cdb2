// Recovery from a rank running out of device memory in a step: every rank gives the step
// up together, nothing is applied, the failing rank's memory cap is set 10% below the
// share that failed, the planner re-splits the batch, and the same samples are trained
// again, so no sample is lost or counted twice. The Trainer uses it
// (TrainerOptions::recoverFromOutOfMemory); a loop of one's own does the same:
//
//   hddp::StepRollback rollback(*model, device);  // BatchNorm statistics, random draws
//   hddp::OutOfMemoryRecovery recovery(comm, ddp, &planner, &rollback, device);
//   for (;;) {
//     ... this rank's share of the next global batch under planner.plan() ...
//     ddp.setBatch(local, global);
//     optimizer.zero_grad();
//     rollback.capture();
//     recovery.run([&] { lossFn(ddp.forward(x), y).backward(); });
//     comm.synchronize();
//     if (auto outcome = recovery.afterBackward(local, step + 1)) {
//       ... serve the same global batch again, split by outcome->after ...
//       continue;
//     }
//     optimizer.step();
//     ...
//   }
//
// Not with SyncBatchNorm (its collectives run in forward, where a rank that failed
// cannot match them) and not without a planner (an equal split cannot move samples: the
// error says what to do).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "hddp/balance/batch_plan.h"

namespace hddp {

class BatchPlanner;
class Communicator;
class DistributedDataParallel;
class StepRollback;

struct OutOfMemoryFailure {
  int rank = 0;
  int64_t localBatch = 0;  // the share it failed at
};

/// What a recovery did: who failed at which share, and the split before and after.
struct OutOfMemoryOutcome {
  std::vector<OutOfMemoryFailure> failures;
  BatchPlan before;
  BatchPlan after;
  /// "step 12: out of memory on rank 1 at 40 samples (...); memory cap learned, split
  /// [..] -> [..]; the step is repeated"
  std::string message;
};

/// After a step some rank abandoned (collective: every rank calls it, with this rank's
/// allocation error, "" when it had none, and its share): gathers the failures (one
/// allgather), caps each failing rank 10% below the share that failed (at least
/// `minLocalBatch`, at least 1; a rank that failed at one sample gets none when
/// `minLocalBatch` is 0) and re-plans. Throws hddp::Error with what to do when balancing
/// is off (`planner` null) or a rank failed at the smallest share. `step` is the
/// 1-based step for the message.
OutOfMemoryOutcome recoverFromOutOfMemory(Communicator& comm, BatchPlanner* planner,
                                          const std::string& mine, int64_t localBatch,
                                          int64_t minLocalBatch, int64_t step);

class OutOfMemoryRecovery {
 public:
  /// Keeps references: `comm`, `ddp`, `planner` and `rollback` (null: the buffers and
  /// generators are not put back) must outlive it. `minLocalBatch`: the planner's.
  OutOfMemoryRecovery(Communicator& comm, DistributedDataParallel& ddp, BatchPlanner* planner,
                      StepRollback* rollback, c10::Device device, int64_t minLocalBatch = 0);

  /// Runs the step's forward and backward. When it runs out of memory
  /// (c10::OutOfMemoryError), empties the device's cache, gives DDP's step up
  /// (abandonStep: zeros go out for the gradients not sent, so the other ranks' step
  /// completes) and returns false; true when it ran, and when the error came after the
  /// step's gradients were all sent (DDP then finishes the step, which stands on every
  /// rank; the log says so). Any other exception passes.
  bool run(const std::function<void()>& forwardAndBackward);

  /// On every rank after the step's collectives were waited for (comm.synchronize()):
  /// nullopt when the step stands. When some rank gave it up: puts back what the forward
  /// changed (the rollback's buffers and generators, PowerSGD's memories), learns the
  /// memory caps and re-plans (recoverFromOutOfMemory: one collective), logs it, and
  /// returns what it did; the caller then serves the same global batch again under
  /// `after`. `step` is the 1-based step for the log.
  std::optional<OutOfMemoryOutcome> afterBackward(int64_t localBatch, int64_t step);

  /// Steps given up and repeated so far.
  int64_t repeatedSteps() const { return repeated_; }

 private:
  Communicator& comm_;
  DistributedDataParallel& ddp_;
  BatchPlanner* planner_;
  StepRollback* rollback_;
  c10::Device device_;
  int64_t minLocalBatch_;
  std::string mine_;  // this rank's allocation error in the last run ("" none)
  int64_t repeated_ = 0;
};

}  // namespace hddp
