// DistributedDataParallel::Impl (ddp/ddp_impl.h): gradient owners (ZeRO stages 1 and 2,
// hddp/ddp/sharded_optimizer.h). Each bucket holds the gradients of one owner and is
// reduced to it; what the other ranks hold of it afterwards is zeros (stage 1) or
// nothing (stage 2: the buffer is freed once sent, at most kForeignInFlight in flight).
#include <algorithm>
#include <map>

#include "ddp/ddp_impl.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {

namespace {

// Foreign buckets (ZeRO-2) whose reduction may be in flight at once during backward:
// one being sent while the next fills (DeepSpeed's overlapped reduction keeps two
// buffers the same way).
constexpr size_t kForeignInFlight = 1;

}  // namespace

void DistributedDataParallel::Impl::setGradientOwners(std::vector<int> owners,
                                                      bool releaseForeign) {
  HDDP_CHECK_AS(ConfigError, step_ == 0 && !stepActive_,
                "setGradientOwners: call it before the first step (", step_,
                " steps synchronized already)");
  HDDP_CHECK_AS(ConfigError, owners.size() == params_.size(), "setGradientOwners: ", owners.size(),
                " owners for ", params_.size(),
                " parameters; give one per DistributedDataParallel::parameters()");
  for (size_t i = 0; i < owners.size(); ++i) {
    HDDP_CHECK_AS(ConfigError, owners[i] >= 0 && owners[i] < comm_.size(),
                  "setGradientOwners: parameter '", params_[i].name, "' is owned by rank ",
                  owners[i], ", not a rank of this ", comm_.size(), "-rank group");
  }
  for (const auto& p : params_) {
    HDDP_CHECK_AS(ConfigError, !p.tensor.grad().defined(), "setGradientOwners: parameter '", p.name,
                  "' holds a gradient (accumulated under noSync()?); set the owners "
                  "(build the ShardedOptimizer) before any backward, or clear the gradients");
  }
  HDDP_CHECK_AS(ConfigError, !options_.commHook && options_.compression == GradCompression::None,
                "setGradientOwners (ZeRO) reduces each bucket to its owner and cannot be combined "
                "with a communication hook or gradient compression; use one or the other");
  owners_ = std::move(owners);
  releaseForeign_ = releaseForeign;
  hookSumsWholeBuffer_ = false;  // the status travels in its own allreduce
  // The hook needs each bucket's owner; buckets are handed over by index.
  hook_ = [this](Communicator& comm, GradBucket& bucket) {
    ReduceOptions options;
    options.root = buckets_[static_cast<size_t>(bucket.index)].owner;
    return CommHookResult{comm.reduce(bucket.buffer, options), nullptr, nullptr};
  };
  // Rebuild the buckets in their present order, split by owner.
  std::vector<int> order;
  for (const auto& b : buckets_) {
    order.insert(order.end(), b.params.begin(), b.params.end());
  }
  buildBuckets(order);
  if (releaseForeign_) {
    for (auto& b : buckets_) {
      if (foreign(b)) {
        release(b);
      }
    }
  }
  int mine = 0;
  int64_t myElements = 0;
  for (const auto& b : buckets_) {
    if (!foreign(b)) {
      ++mine;
      myElements += b.elements;
    }
  }
  HDDP_LOG_INFO("ddp", "gradient owners set (ZeRO-", releaseForeign_ ? 2 : 1,
                "): ", buckets_.size(), " bucket(s), ", mine, " reduced to this rank (", myElements,
                " elements)");
}

std::vector<std::vector<int>> DistributedDataParallel::Impl::splitByOwner(
    const std::vector<std::vector<int>>& buckets) const {
  std::vector<std::vector<int>> split;
  for (const auto& bucket : buckets) {
    // Owners in the order they first appear in the bucket; each keeps its order.
    std::vector<int> ownersSeen;
    std::map<int, std::vector<int>> byOwner;
    for (int index : bucket) {
      const int owner = owners_[static_cast<size_t>(index)];
      if (byOwner.find(owner) == byOwner.end()) {
        ownersSeen.push_back(owner);
      }
      byOwner[owner].push_back(index);
    }
    for (int owner : ownersSeen) {
      split.push_back(std::move(byOwner[owner]));
    }
  }
  return split;
}

void DistributedDataParallel::Impl::release(Bucket& b) {
  for (int index : b.params) {
    params_[static_cast<size_t>(index)].tensor.mutable_grad() = at::Tensor();
  }
  b.flat = at::Tensor();
  // The completed reduction's Work holds the buffer too (the backend's reference, and a
  // staged copy's target): dropped with it, or the memory would stay until the next step.
  b.work = Work();
}

void DistributedDataParallel::Impl::releaseSentForeignBuckets(bool keepInFlight) {
  const size_t keep = keepInFlight ? kForeignInFlight : 0;
  while (foreignInFlight_.size() > keep) {
    Bucket& b = buckets_[static_cast<size_t>(foreignInFlight_.front())];
    foreignInFlight_.erase(foreignInFlight_.begin());
    b.work.wait();  // the backend reads the buffer until the reduction completes
    release(b);
  }
}

void DistributedDataParallel::Impl::settleForeignGradients() {
  if (!sharded()) {
    return;
  }
  if (releaseForeign_) {
    releaseSentForeignBuckets(/*keepInFlight=*/false);
    for (auto& b : buckets_) {
      if (foreign(b)) {
        release(b);
      }
    }
    return;
  }
  // ZeRO-1: the backend used the foreign buffers as scratch; they become zeros, so a
  // gradient nobody clears sends nothing stale into the next step's sum.
  at::NoGradGuard noGrad;
  for (auto& b : buckets_) {
    if (!foreign(b)) {
      continue;
    }
    b.flat.zero_();
    for (int index : b.params) {
      at::Tensor& grad = params_[static_cast<size_t>(index)].tensor.mutable_grad();
      if (grad.defined() &&
          grad.data_ptr() != sliceOf(params_[static_cast<size_t>(index)]).data_ptr()) {
        grad.zero_();
      }
    }
  }
}

}  // namespace hddp
