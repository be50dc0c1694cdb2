// DistributedDataParallel::Impl (ddp/ddp_impl.h): the buckets, their layout and its
// rebuild from the order gradients were ready in.
#include <torch/torch.h>

#include <algorithm>

#include "ddp/bucketing.h"
#include "ddp/coalesced.h"
#include "ddp/ddp_impl.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {

void DistributedDataParallel::Impl::buildBuckets(const std::vector<int>& order) {
  std::vector<at::Tensor> tensors;
  for (const auto& p : params_) {
    tensors.push_back(p.tensor);
  }
  auto assignment =
      ddp::assignBuckets(tensors, order, options_.firstBucketBytes, options_.bucketCapBytes);
  if (sharded()) {
    assignment = splitByOwner(assignment);
  }
  std::vector<Bucket> buckets(assignment.size());
  for (size_t bi = 0; bi < assignment.size(); ++bi) {
    Bucket& b = buckets[bi];
    b.params = assignment[bi];
    int64_t total = 0;
    for (int index : b.params) {
      total += params_[index].tensor.numel();
    }
    b.elements = total;
    b.owner = sharded() ? owners_[static_cast<size_t>(b.params.front())] : -1;
  }
  // Move current gradients into the new buffers: the old buffers go first (a gradient
  // that is a view keeps its buffer alive) and the new ones are allocated after, so that a
  // rebuild holds one copy more of the gradients, not two. With owners, a foreign gradient (zeros,
  // or already released) is not carried: the next step sends zeros for it as for any cleared
  // gradient.
  std::vector<at::Tensor> oldGrads;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& grad = params_[i].tensor.mutable_grad();
    const bool carried = grad.defined() && (!sharded() || owners_[i] == comm_.rank());
    oldGrads.push_back(carried ? grad.detach().clone() : at::Tensor());
    grad = at::Tensor();
  }
  at::Tensor status =
      buckets_.empty() || (sharded() && !status_.defined()) ? at::Tensor() : statusSlot().clone();
  if (sharded() && !status_.defined() && !buckets.empty()) {
    status_ = at::zeros(
        {1}, params_[buckets.front().params.front()].tensor.options().requires_grad(false));
  }
  buckets_ = std::move(buckets);
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    int64_t offset = 0;
    for (int index : buckets_[bi].params) {
      params_[index].bucket = static_cast<int>(bi);
      params_[index].offset = offset;
      offset += params_[index].tensor.numel();
    }
  }
  // The buffers, once the old ones are gone. Lazily (allocateBucketsLazily) only until
  // the owners are known: then a rank's own buckets, and at stage 1 every bucket, are
  // held from here on, so that backward allocates no bucket it keeps (an allocation that
  // fails in a gradient hook would leave the step half sent). A foreign bucket at stage 2
  // is allocated when its first gradient arrives and freed once reduced.
  for (auto& b : buckets_) {
    const bool released = releaseForeign_ && foreign(b);
    if (!released && (sharded() || !options_.allocateBucketsLazily)) {
      ensureFlat(b);
      if (!sharded() && &b == &buckets_.back()) {
        statusSlot().zero_();
      }
    }
  }
  if (status.defined() && !buckets_.empty()) {
    statusSlot().copy_(status);  // a rebuild after an abandoned step keeps its status
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (oldGrads[i].defined()) {
      ensureFlat(buckets_[static_cast<size_t>(params_[i].bucket)]);
      at::Tensor view = sliceOf(params_[i]);
      view.copy_(oldGrads[i]);
      params_[i].tensor.mutable_grad() = options_.gradientAsBucketView ? view : oldGrads[i];
    }
  }
}

void DistributedDataParallel::Impl::ensureFlat(Bucket& b) {
  if (!b.flat.defined()) {
    // Without owners the last bucket carries the step's status too (zeros: read before
    // the step writes it). Otherwise every element is written before it is read: each
    // parameter's slice by its gradient, or zeros, when it is marked ready.
    const int64_t status = !sharded() && &b == &buckets_.back() ? 1 : 0;
    const auto options =
        params_[static_cast<size_t>(b.params.front())].tensor.options().requires_grad(false);
    b.flat = status ? at::zeros({b.elements + status}, options) : at::empty({b.elements}, options);
  }
}

void DistributedDataParallel::Impl::rebuildFromObservedOrder() {
  // Rank 0's order is the one everybody uses: ranks may observe different orders.
  at::Tensor order = at::empty({static_cast<int64_t>(params_.size())}, at::kLong);
  for (size_t i = 0; i < readyOrder_.size() && i < params_.size(); ++i) {
    order[i] = readyOrder_[i];
  }
  if (comm_.device().is_cuda()) {
    at::Tensor onDevice = order.to(comm_.device());
    comm_.broadcast(onDevice, 0).wait();
    order = onDevice.cpu();
  } else {
    comm_.broadcast(order, 0).wait();
  }
  std::vector<int> rebuilt(order.data_ptr<int64_t>(), order.data_ptr<int64_t>() + order.numel());
  std::vector<int> sorted = rebuilt;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    HDDP_INTERNAL_ASSERT(sorted[i] == static_cast<int>(i),
                         "observed gradient order is not a permutation");
  }
  buildBuckets(rebuilt);
  HDDP_LOG_DEBUG("ddp", "rebuilt ", buckets_.size(), " bucket(s) from the observed gradient order");
}

}  // namespace hddp
