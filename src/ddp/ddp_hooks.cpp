// DistributedDataParallel::Impl (ddp/ddp_impl.h): the gradient hooks, buckets filling
// up as gradients arrive, and their launch.
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>

#include "core/gradient_capture.h"
#include "ddp/ddp_impl.h"
#include "ddp/ready_hook.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {

void DistributedDataParallel::Impl::setBatch(int64_t local, int64_t global) {
  HDDP_CHECK(global > 0, "setBatch: the global batch must be positive, got ", global);
  HDDP_CHECK(local >= 0 && local <= global, "setBatch: the local batch ", local,
             " must be between 0 and the global batch ", global);
  weight_ = static_cast<double>(local) / static_cast<double>(global);
  bufferWeight_ += weight_;
  batchSet_ = true;
  stepDone_ = false;  // a new step: finalize() synchronizes again
  collectivesEnded_ = false;
}

void DistributedDataParallel::Impl::registerHooks() {
  for (size_t i = 0; i < params_.size(); ++i) {
    registerHook(static_cast<int>(i));
  }
}

void DistributedDataParallel::Impl::registerHook(int i) {
  Param& p = params_[static_cast<size_t>(i)];
  // Runs on every incoming gradient before it is accumulated: weighting by b_i / B
  // (also under noSync, so accumulated micro-steps carry their own b/B).
  p.preHookIndex = p.tensor.register_hook([this, i](const at::Tensor& incoming) -> at::Tensor {
    Param& param = params_[static_cast<size_t>(i)];
    holdOver(param);
    const at::Tensor& grad = incoming;
    if (detail::capturingInnerGradients()) {
      return grad;  // a checkpoint recomputation: weighted when it reaches the parameter
    }
    if (weight_ == 0.0) {
      // No samples on this rank: its loss over an empty batch may be NaN, and NaN x 0
      // would poison every rank's sum. A zero share contributes exact zeros.
      return at::zeros_like(grad);
    }
    return weight_ == 1.0 ? grad : grad * weight_;
  });
  auto& slot = torch::autograd::impl::post_acc_grad_hooks(p.tensor);
  torch::autograd::impl::set_post_acc_grad_hooks(
      p.tensor,
      std::make_unique<ddp::ReadyHook>([this, i] { onGradientReady(i); }, std::move(slot)));
}

// PyTorch's semantics for a gradient that the user did not clear between two
// synchronized steps (loss1.backward(); loss2.backward()): each backward's gradient
// is reduced once. .grad still holds the last step's sum over ranks, identical on
// every rank; sending it divided by the world size makes the next sum
// old + new instead of size x old + new.
void DistributedDataParallel::Impl::holdOver(Param& p) {
  if (!p.holdsReduced) {
    return;
  }
  if (sharded()) {
    // Only the owner holds the sum; the others' gradients of it are zeros or released.
    // Sending it as it is makes the next sum old + new.
    p.holdsReduced = false;
    return;
  }
  p.holdsReduced = false;
  at::Tensor& grad = p.tensor.mutable_grad();
  if (grad.defined()) {
    at::NoGradGuard noGrad;
    grad.div_(static_cast<double>(comm_.size()));
  }
}

// A tensor hook may not change a gradient's layout, so a sparse gradient (Embedding
// with sparse=true) is accumulated sparse and made dense here, when it enters its
// bucket; from then on .grad is dense (AccumulateGrad adds sparse into dense).
void DistributedDataParallel::Impl::densify(const Param& p, at::Tensor& grad) {
  if (!warnedSparse_) {
    warnedSparse_ = true;
    HDDP_LOG_WARN("ddp", "parameter '", p.name,
                  "' received a sparse gradient (e.g. Embedding with sparse=true); "
                  "DistributedDataParallel allreduces dense buckets, so sparse gradients are "
                  "made dense (same result, the full tensor's bytes on the wire)");
  }
  grad = grad.to_dense();
}

void DistributedDataParallel::Impl::onGradientReady(int index) {
  Param& p = params_[static_cast<size_t>(index)];
  p.used = p.used || p.tensor.grad().defined();  // under noSync() too, as PyTorch
  if (noSync_) {
    return;
  }
  if (!stepActive_) {
    beginStep();
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
  }
  markReady(index, /*duringBackward=*/true);
}

void DistributedDataParallel::Impl::beginStep() {
  stepActive_ = true;
  stepDone_ = false;
  collectivesEnded_ = false;
  nextBucket_ = 0;
  stats_ = DdpStepStats{};
  stats_.buckets = static_cast<int>(buckets_.size());
  abandonedLocally_ = false;
  holdBuckets_ = holdBucketsUntilBackwardEnds();
  if (!buckets_.empty()) {
    statusSlot().zero_();
  }
  for (auto& p : params_) {
    p.ready = false;
  }
  readyCount_ = 0;
  for (auto& b : buckets_) {
    b.pending = static_cast<int>(b.params.size());
    b.launched = false;
    b.completedAtNs = std::make_shared<std::atomic<int64_t>>(0);
  }
  if (recordOrder_) {
    readyOrder_.clear();
  }
}

// The parameter's slice of its bucket, as a tensor that shares the bucket's storage
// without being an autograd view: LibTorch's C++ Optimizer::zero_grad() calls
// detach_() on every gradient, which views refuse.
at::Tensor DistributedDataParallel::Impl::sliceOf(const Param& p) {
  const Bucket& b = buckets_[p.bucket];
  at::Tensor alias = at::empty({0}, b.flat.options());
  alias.set_(b.flat.storage(), b.flat.storage_offset() + p.offset, p.tensor.sizes(),
             c10::contiguous_strides(p.tensor.sizes()));
  return alias;
}

void DistributedDataParallel::Impl::markReady(int index, bool duringBackward) {
  Param& p = params_[index];
  HDDP_CHECK(!p.ready, "parameter '", p.name, "' received a gradient twice in one step. ",
             "Is it used in two backward passes before the step ended? Use noSync() for "
             "gradient accumulation, and non-reentrant activation checkpointing.");
  // First the bucket's buffer (a released foreign bucket at ZeRO-2): an allocation that
  // fails leaves the parameter not ready, so an abandoned step still sends it.
  ensureFlat(buckets_[static_cast<size_t>(p.bucket)]);
  p.ready = true;
  ++readyCount_;
  if (recordOrder_) {
    readyOrder_.push_back(index);
  }
  holdOver(p);  // no gradient reached it in this step (unused, or a rank without samples)
  at::Tensor view = sliceOf(p);
  at::Tensor& grad = p.tensor.mutable_grad();
  if (grad.defined() && grad.is_sparse()) {
    densify(p, grad);
  }
  if (!grad.defined()) {
    view.zero_();  // unused parameter (or a rank without samples): contributes zeros
    if (options_.gradientAsBucketView) {
      grad = view;
    }
  } else if (grad.data_ptr() != view.data_ptr()) {
    view.copy_(grad);
    if (options_.gradientAsBucketView) {
      grad = view;
    }
  }
  Bucket& b = buckets_[p.bucket];
  if (--b.pending == 0) {
    launchReadyBuckets(duringBackward);
  }
}

// Buckets are launched strictly in index order, so every rank issues the same
// collectives in the same order.
void DistributedDataParallel::Impl::launchReadyBuckets(bool duringBackward) {
  if (duringBackward && holdBuckets_) {
    return;  // finalize() sends them, in index order, after the last SyncBatchNorm's
  }
  while (nextBucket_ < static_cast<int>(buckets_.size()) && buckets_[nextBucket_].pending == 0) {
    Bucket& b = buckets_[nextBucket_];
    if (options_.beforeBucketLaunch) {
      options_.beforeBucketLaunch(nextBucket_);
    }
    b.launchedAt = ddp::Clock::now();
    const bool isLast = nextBucket_ + 1 == static_cast<int>(buckets_.size());
    GradBucket bucket;
    bucket.index = nextBucket_;
    bucket.isLast = isLast;
    int64_t gradientElements = 0;
    for (int index : b.params) {
      bucket.parameters.push_back(params_[index].tensor);
      bucket.offsets.push_back(params_[index].offset);
      bucket.names.push_back(params_[index].name);
      gradientElements += params_[index].tensor.numel();
    }
    // A user's hook sees the gradients only; the status slot (last bucket) is summed
    // separately below.
    bucket.buffer = hookSumsWholeBuffer_ ? b.flat : b.flat.narrow(0, 0, gradientElements);
    CommHookResult sent = hook_(comm_, bucket);
    // Sent: from here on the bucket is not launched again (finalize() launches a bucket
    // whose hook threw, and only that).
    b.work = std::move(sent.work);
    b.finish = std::move(sent.finish);
    b.then = std::move(sent.then);
    b.launched = true;
    ++nextBucket_;
    b.work.onCompletion(
        [done = b.completedAtNs] { done->store(ddp::Clock::now().time_since_epoch().count()); });
    // "During backward": gradients of other parameters were still to come.
    if (duringBackward && readyCount_ < params_.size()) {
      ++stats_.bucketsLaunchedDuringBackward;
    }
    if (isLast && !hookSumsWholeBuffer_) {
      statusWire_ = statusSlot().clone();
      statusWork_ = comm_.allreduce(statusWire_);
    }
    if (releaseForeign_ && foreign(b)) {
      foreignInFlight_.push_back(nextBucket_ - 1);
      releaseSentForeignBuckets(/*keepInFlight=*/true);
    }
  }
}

}  // namespace hddp
