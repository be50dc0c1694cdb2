// Recovery from a rank running out of memory in a step (hddp/train/out_of_memory.h).
#include "hddp/train/out_of_memory.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "hddp/balance/planner.h"
#include "hddp/comm/communicator.h"
#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "hddp/ddp/power_sgd.h"
#include "hddp/train/step_rollback.h"

namespace hddp {
namespace {

std::vector<OutOfMemoryFailure> gatherFailures(Communicator& comm, bool failedHere,
                                               int64_t localBatch) {
  struct Report {
    int64_t failed;
    int64_t localBatch;
  };
  const auto all = allgatherValue(comm, Report{failedHere ? 1 : 0, localBatch});
  std::vector<OutOfMemoryFailure> failures;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].failed != 0) {
      failures.push_back({static_cast<int>(r), all[r].localBatch});
    }
  }
  HDDP_INTERNAL_ASSERT(!failures.empty(), "a step was abandoned but no rank reports a failure");
  return failures;
}

std::string firstLine(const std::string& text) { return text.substr(0, text.find('\n')); }

}  // namespace

OutOfMemoryOutcome recoverFromOutOfMemory(Communicator& comm, BatchPlanner* planner,
                                          const std::string& mine, int64_t localBatch,
                                          int64_t minLocalBatch, int64_t step) {
  OutOfMemoryOutcome result;
  result.failures = gatherFailures(comm, !mine.empty(), localBatch);
  result.before = planner ? planner->plan() : BatchPlan{};
  for (const auto& f : result.failures) {
    HDDP_CHECK(planner != nullptr, "rank ", f.rank, " ran out of memory with its equal share of ",
               f.localBatch,
               " samples (balancing is off). Lower the global batch, use mixed precision or "
               "activation checkpointing, or turn balancing on so the planner gives that rank "
               "fewer samples.");
    const int64_t floorShare = std::max<int64_t>(1, minLocalBatch);
    if (minLocalBatch == 0 && f.localBatch <= 1) {
      // Not even one sample fits (a rank probed at 1 sample, or a card too small for
      // the model): it trains on nothing from now on; the others take its share.
      planner->setMemoryCap(f.rank, 0);
      continue;
    }
    HDDP_CHECK(f.localBatch > floorShare, "rank ", f.rank, " ran out of memory with ", f.localBatch,
               " sample(s) in its step: the model does not fit on that device even at the "
               "smallest share. Use mixed precision or activation checkpointing, or leave the "
               "device out.");
    // 10% below the failing size (at least one sample): a few retries at most find a
    // size that fits, and fragmentation gets some room.
    const int64_t cap =
        std::max(floorShare, f.localBatch - std::max<int64_t>(1, f.localBatch / 10));
    planner->setMemoryCap(f.rank, cap);
  }
  result.after = planner->plan();
  std::ostringstream who;
  for (const auto& f : result.failures) {
    who << (who.tellp() > 0 ? ", " : "") << "rank " << f.rank << " at " << f.localBatch
        << " samples";
  }
  result.message = c10::str("step ", step, ": out of memory on ", who.str(),
                            mine.empty() ? std::string() : " (" + firstLine(mine) + ")",
                            "; memory cap learned, split ", result.before.describe(), " -> ",
                            result.after.describe(), "; the step is repeated");
  return result;
}

OutOfMemoryRecovery::OutOfMemoryRecovery(Communicator& comm, DistributedDataParallel& ddp,
                                         BatchPlanner* planner, StepRollback* rollback,
                                         c10::Device device, int64_t minLocalBatch)
    : comm_(comm),
      ddp_(ddp),
      planner_(planner),
      rollback_(rollback),
      device_(device),
      minLocalBatch_(minLocalBatch) {}

bool OutOfMemoryRecovery::run(const std::function<void()>& forwardAndBackward) {
  mine_.clear();
  try {
    forwardAndBackward();
    return true;
  } catch (const c10::OutOfMemoryError& e) {
    if (device_.type() != c10::kCPU) {
      c10::getDeviceAllocator(device_.type())->emptyCache();
    }
    mine_ = e.what_without_backtrace();
    if (!ddp_.abandonStep()) {
      // Too late to give up: every gradient was sent, DDP finished the step, and it stands
      // with the same sums on every rank (throwing here, on this rank alone, would leave
      // the others in their next collective).
      HDDP_LOG_WARN("train", "rank ", comm_.rank(), " ran out of memory after its gradients were ",
                    "all sent (", mine_, "): the step stands");
      mine_.clear();
      return true;
    }
    return false;
  }
}

std::optional<OutOfMemoryOutcome> OutOfMemoryRecovery::afterBackward(int64_t localBatch,
                                                                     int64_t step) {
  if (!ddp_.lastStepAbandoned()) {
    mine_.clear();
    return std::nullopt;
  }
  // The abandoned step leaves no trace: the forward's normalisation statistics and random
  // draws, and PowerSGD's memories, are put back, so the repeat trains as a straight run
  // of the new split would (the optimizer, scaler and sampler were not touched).
  if (rollback_) {
    rollback_->restore();
  }
  if (const auto& powerSgd = ddp_.powerSgdState()) {
    powerSgd->discardStep();
  }
  OutOfMemoryOutcome outcome =
      recoverFromOutOfMemory(comm_, planner_, mine_, localBatch, minLocalBatch_, step);
  ++repeated_;
  // Rank 0 and the failing ranks warn; the others note it.
  if (comm_.rank() == 0 || !mine_.empty()) {
    HDDP_LOG_WARN("train", outcome.message);
  } else {
    HDDP_LOG_INFO("train", outcome.message);
  }
  mine_.clear();
  return outcome;
}

}  // namespace hddp
