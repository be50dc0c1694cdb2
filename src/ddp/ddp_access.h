// What the Trainer uses of DistributedDataParallel beyond its public API (internal to
// libhddp): giving up a step after running out of memory, reading whether some rank did,
// and the buckets' allreduce times for the timeline.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "hddp/ddp/distributed_data_parallel.h"

namespace hddp {

/// One bucket's allreduce in a step, launch to completion (for timelines).
struct BucketTiming {
  std::chrono::steady_clock::time_point launched;
  std::chrono::steady_clock::time_point completed;
  int64_t bytes = 0;
};

namespace detail {

struct DdpAccess {
  /// For a rank that cannot finish its forward or backward in this step (it ran out of
  /// memory): sends zeros for the gradients it has not sent and marks the step as
  /// abandoned, so the step's collectives complete on every rank. Call it after the
  /// failed forward/backward, instead of finalize(). Returns false when it came too
  /// late (every gradient was already sent); the step then stands as it is.
  static bool abandonStep(DistributedDataParallel& ddp);
  /// True on every rank when some rank abandoned the last synchronized step: its
  /// gradients are then incomplete and the optimizer step must be skipped. The status
  /// travels in the last bucket's allreduce (one extra element), so this costs no extra
  /// collective; reading it waits for the device. An abandoned step then does not count
  /// in DDP's step count (which paces DdpOptions::bufferSyncInterval).
  static bool lastStepAbandoned(DistributedDataParallel& ddp);
  /// The caller put the buffers back as they were before the last synchronized step's
  /// forward (a step the GradScaler skipped, on every rank): their weight in the next
  /// synchronisation goes back too. The step still counts (as PyTorch's iteration does).
  static void putBackStepBuffers(DistributedDataParallel& ddp);
  /// Each bucket's allreduce in the last synchronized step, in launch order.
  static const std::vector<BucketTiming>& bucketTimes(const DistributedDataParallel& ddp);
  /// The parameters in bucket order (bucketLayout() flattened): what a state file keeps
  /// so that a resumed run has the buckets of the run it continues.
  static std::vector<std::string> bucketOrder(const DistributedDataParallel& ddp);
  /// Builds the buckets from `names` (a bucketOrder() of the same model) and skips the
  /// rebuild after the first step: a hook's per-bucket memories (PowerSGD's) then fit
  /// the buckets they were made for. Call it on every rank before the first step. False
  /// (nothing changed) when the names are not exactly the model's parameters.
  static bool adoptBucketOrder(DistributedDataParallel& ddp, const std::vector<std::string>& names);
};

}  // namespace detail
}  // namespace hddp
