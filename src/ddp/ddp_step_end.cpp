// DistributedDataParallel::Impl (ddp/ddp_impl.h): the end of a synchronized backward, an
// abandoned step, the buffers' synchronisation (the buckets' layout is in
// ddp_buckets.cpp).
#include <torch/csrc/autograd/engine.h>

#include <algorithm>

#include "ddp/bucketing.h"
#include "ddp/coalesced.h"
#include "ddp/ddp_impl.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {

using ddp::Clock;
using ddp::secondsBetween;

// Out of memory after the step's collectives ended (a hook's second round being issued,
// its finish, the gradients' copies): the peers have their sums and go on, so the step
// can be neither abandoned nor repeated; an out-of-memory error would make the caller
// try both (DESIGN.md: a collective is agreed). Before that point (stepActive_ still
// set) it stays what it is: abandonStep() sends what is left.
void DistributedDataParallel::Impl::finalize() {
  try {
    finalizeStep();
  } catch (const c10::OutOfMemoryError& e) {
    if (stepActive_) {
      throw;
    }
    collectivesEnded_ = true;
    HDDP_THROW(DistributedError, "rank ", comm_.rank(),
               " ran out of memory after the step's collectives were sent (",
               e.what_without_backtrace(),
               "); the step can be neither abandoned nor repeated: the other ranks have their "
               "sums and go on without it, into collectives this rank will not send (they "
               "fail at their timeout). Resume from the last checkpoint with a smaller share "
               "on this rank (--max-local-batch)");
  }
}

void DistributedDataParallel::Impl::finalizeStep() {
  HDDP_CHECK(!noSync_,
             "finalize() inside noSync(): gradients are only synchronized "
             "outside the noSync scope");
  if (!stepActive_ && stepDone_) {
    // This step's gradients are already summed (backward ended it): sending them
    // again would multiply them by the world size. The next step starts at
    // setBatch() or at its first gradient.
    HDDP_LOG_DEBUG("ddp", "finalize(): the step is already synchronized, nothing to do");
    return;
  }
  const bool ranBackward = stepActive_;
  if (!ranBackward) {
    beginStep();  // a rank without samples this step: everything contributes zeros
  }
  std::vector<std::string> unused;
  priorGrads_.clear();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].ready) {
      if (ranBackward && !abandoning_) {
        unused.push_back(params_[i].name);
      }
      keepPriorGradient(i);
      markReady(static_cast<int>(i), /*duringBackward=*/false);
    }
  }
  stats_.unusedParameters = static_cast<int>(unused.size());
  // A bucket whose hook threw at its launch (out of memory on the autograd thread) is
  // ready but not sent: send it now, as the other ranks will wait for it.
  launchReadyBuckets(/*duringBackward=*/false);
  launchUsedMap();
  const auto waitStart = Clock::now();
  std::exception_ptr failure;
  auto waitFor = [&failure](Work& work) {
    try {
      work.wait();
    } catch (...) {
      if (!failure) {
        failure = std::current_exception();
      }
    }
  };
  for (auto& b : buckets_) {
    waitFor(b.work);
  }
  waitFor(statusWork_);
  statusWork_ = Work();
  waitFor(usedWork_);
  usedWork_ = Work();
  // A hook's second round (PowerSGD's Q): started in bucket order on every rank once
  // every first round completed, then waited for. A rank whose first round failed
  // starts none (its peers then fail on their timeouts, as for any lost collective).
  std::vector<std::function<void()>> secondFinish(buckets_.size());
  if (!failure) {
    std::vector<Work> second;
    for (size_t i = 0; i < buckets_.size() && !failure; ++i) {
      Bucket& b = buckets_[i];
      if (!b.then) {
        continue;
      }
      try {
        CommHookResult more = b.then();
        HDDP_CHECK(!more.then, "a comm hook's second round (`then`) returned a third; ",
                   "DDP runs two rounds at most");
        more.work.onCompletion(
            [done = b.completedAtNs] { done->store(Clock::now().time_since_epoch().count()); });
        second.push_back(std::move(more.work));
        secondFinish[i] = std::move(more.finish);
      } catch (...) {
        failure = std::current_exception();
      }
      b.then = nullptr;
    }
    for (auto& w : second) {
      waitFor(w);
    }
  }
  const auto waitEnd = Clock::now();
  stepActive_ = false;
  stepDone_ = true;
  for (auto& p : params_) {
    p.holdsReduced = true;
  }
  if (failure) {
    for (auto& b : buckets_) {
      b.finish = nullptr;
      b.then = nullptr;
    }
    usedMap_ = at::Tensor();
    priorGrads_.clear();
    std::rethrow_exception(failure);
  }
  if (statusWire_.defined()) {
    statusSlot().copy_(statusWire_);
    statusWire_ = at::Tensor();
  }
  stats_.waitSeconds = ranBackward ? secondsBetween(waitStart, waitEnd) : 0.0;
  int64_t lastDone = 0;
  for (auto& b : buckets_) {
    lastDone = std::max(lastDone, b.completedAtNs->load());
  }
  bucketTimes_.clear();
  for (auto& b : buckets_) {
    const int64_t done = b.completedAtNs->load();
    bucketTimes_.push_back(BucketTiming{
        b.launchedAt, done > 0 ? Clock::time_point(Clock::duration(done)) : waitEnd,
        b.elements * static_cast<int64_t>(
                         params_[static_cast<size_t>(b.params.front())].tensor.element_size())});
  }
  if (!buckets_.empty()) {
    const auto last = Clock::time_point(Clock::duration(lastDone));
    stats_.communicationSeconds =
        secondsBetween(buckets_.front().launchedAt, std::max(last, waitStart));
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    if (b.finish) {
      auto finish = std::move(b.finish);
      b.finish = nullptr;
      finish();
    }
    if (secondFinish[i]) {
      secondFinish[i]();
    }
  }
  const std::vector<bool> untouched = unusedEverywhere();
  settleForeignGradients();
  if (!options_.gradientAsBucketView) {
    for (size_t i = 0; i < params_.size(); ++i) {
      Param& p = params_[i];
      if (foreign(buckets_[static_cast<size_t>(p.bucket)]) ||
          (!untouched.empty() && untouched[i])) {
        continue;
      }
      at::Tensor& grad = p.tensor.mutable_grad();
      if (grad.defined()) {
        grad.copy_(sliceOf(p));
      } else {
        grad = sliceOf(p).clone();
      }
    }
  }
  restoreUnusedEverywhere(untouched);
  ++step_;
  stepCounted_ = true;
  weightBeforeStep_ = weightAfterStep_;
  if (options_.bufferSync == BufferSync::WithGradients && !buffers_.empty() &&
      step_ % options_.bufferSyncInterval == 0) {
    syncBuffers();
  }
  weightAfterStep_ = bufferWeight_;
  if (recordOrder_) {
    // Every rank takes this branch after its first synchronized step (whether or not
    // it had samples), so the broadcast of rank 0's order is matched everywhere.
    recordOrder_ = false;
    if (options_.rebuildBuckets && comm_.size() > 1) {
      rebuildFromObservedOrder();
    }
  }
  if (!unused.empty() && !options_.findUnusedParameters) {
    std::ostringstream names;
    for (size_t i = 0; i < unused.size() && i < 8; ++i) {
      names << (i ? ", " : "") << "'" << unused[i] << "'";
    }
    if (unused.size() > 8) {
      names << ", ... (" << unused.size() << " in all)";
    }
    HDDP_THROW(Error, "parameter(s) ", names.str(), " received no gradient in this backward ",
               "(rank ", comm_.rank(),
               "). Zeros were sent for them so no rank hangs. If your "
               "model skips these parameters on purpose, set DdpOptions::findUnusedParameters "
               "= true; otherwise make sure the loss depends on them.");
  }
}

// Before a parameter that no gradient reached on this rank is marked ready (which may
// divide a held-over .grad in place, and with gradients as bucket views points .grad at
// its slice, which the reduction overwrites): what .grad was, in case no rank used it.
void DistributedDataParallel::Impl::keepPriorGradient(size_t index) {
  const Param& p = params_[index];
  // An abandoned step is never applied (the optimizer skips it and the repeat clears the
  // gradients): nothing to keep, and no copy on a device that just ran out of memory.
  if (!options_.findUnusedParameters || p.used || abandoning_) {
    return;
  }
  priorGrads_.resize(params_.size());
  PriorGrad& prior = priorGrads_[index];
  prior.kept = true;
  prior.tensor = p.tensor.grad();
  prior.value = prior.tensor.defined() ? prior.tensor.detach().clone() : at::Tensor();
}

// PyTorch's local_used_map allreduce: one int per parameter, launched after the last
// bucket on every rank (each runs finalize(), an abandoned step included), so the
// collectives stay in the same order everywhere. The flags start again for the next step.
void DistributedDataParallel::Impl::launchUsedMap() {
  usedMap_ = at::Tensor();
  if (!options_.findUnusedParameters || params_.empty()) {
    return;
  }
  std::vector<int32_t> used(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    used[i] = params_[i].used ? 1 : 0;
    params_[i].used = false;
  }
  usedMap_ = at::tensor(used, at::kInt).to(comm_.device());
  if (comm_.size() > 1) {
    usedWork_ = comm_.allreduce(usedMap_);
  }
}

std::vector<bool> DistributedDataParallel::Impl::unusedEverywhere() {
  if (!usedMap_.defined()) {
    return {};
  }
  const at::Tensor sums = usedMap_.cpu();  // the allreduce was waited for with the buckets
  usedMap_ = at::Tensor();
  std::vector<bool> unused(params_.size(), false);
  const auto* counts = sums.data_ptr<int32_t>();
  for (size_t i = 0; i < params_.size(); ++i) {
    unused[i] = counts[i] == 0;
  }
  return unused;
}

// A parameter no rank used keeps the .grad it had (PyTorch leaves it untouched): an
// undefined one stays undefined, so the optimizer skips the parameter (no weight decay,
// no momentum); a defined one (zeros after zero_grad(false)) keeps its values. Not
// applied to a ZeRO rank's foreign parameters, whose gradients it never steps (zeros at
// stage 1, none at stage 2).
void DistributedDataParallel::Impl::restoreUnusedEverywhere(const std::vector<bool>& unused) {
  at::NoGradGuard noGrad;
  for (size_t i = 0; i < unused.size(); ++i) {
    Param& p = params_[i];
    if (!unused[i] || i >= priorGrads_.size() || !priorGrads_[i].kept ||
        foreign(buckets_[static_cast<size_t>(p.bucket)])) {
      continue;
    }
    PriorGrad& prior = priorGrads_[i];
    at::Tensor& grad = p.tensor.mutable_grad();
    grad = prior.tensor;
    if (grad.defined()) {
      grad.copy_(prior.value);
    }
  }
  priorGrads_.clear();
}

bool DistributedDataParallel::Impl::abandonStep() {
  HDDP_CHECK(!noSync_, "abandonStep() inside noSync(): nothing is being synchronized");
  if (collectivesEnded_) {
    return false;  // finalize() failed after the step's collectives: too late
  }
  if (!stepActive_) {
    beginStep();
  }
  if (nextBucket_ >= static_cast<int>(buckets_.size()) && !buckets_.empty()) {
    // Too late: every bucket went out (the backward failed after its last gradient, e.g.
    // in a node past the parameters). The step stands: finish it as backward's end would
    // have (the used map, the second rounds, the gradients), so that the peers' remaining
    // collectives are matched and this rank holds the same sums as they do.
    finalize();
    return false;
  }
  abandoning_ = true;
  abandonedLocally_ = true;
  if (!buckets_.empty()) {
    statusSlot().fill_(1);
  }
  try {
    finalize();
  } catch (...) {
    abandoning_ = false;
    throw;
  }
  abandoning_ = false;
  return true;
}

bool DistributedDataParallel::Impl::lastStepAbandoned() {
  if (buckets_.empty()) {
    return discountIfAbandoned(abandonedLocally_);
  }
  // The slot holds the sum over ranks after the last bucket's allreduce.
  return discountIfAbandoned(statusSlot().item<double>() > 0.5);
}

// An abandoned step does not count: the step count paces bufferSyncInterval, and the
// repeat must sync the buffers where a straight run of the new split does, with the
// weights a straight run has. Every rank
// reads the same status, so every rank takes the count back together (once per step).
bool DistributedDataParallel::Impl::discountIfAbandoned(bool abandoned) {
  if (abandoned && stepCounted_) {
    // Nor do its shares weigh the buffers: they go back to the weight after the last step
    // that stood (the step's buffers themselves are the caller's to put back).
    --step_;
    bufferWeight_ = weightBeforeStep_;
    weightAfterStep_ = weightBeforeStep_;
  }
  stepCounted_ = false;
  return abandoned;
}

void DistributedDataParallel::Impl::putBackStepBuffers() {
  bufferWeight_ = weightBeforeStep_;
  weightAfterStep_ = weightBeforeStep_;
}

// The last element of the last bucket (launched last): 0 from every rank that
// finished the step, 1 from a rank that abandoned it; summed by the allreduce.
at::Tensor DistributedDataParallel::Impl::statusSlot() {
  if (sharded()) {
    return status_;
  }
  ensureFlat(buckets_.back());
  const at::Tensor& flat = buckets_.back().flat;
  return flat.narrow(0, flat.numel() - 1, 1);
}

// Buffers become the sample-weighted mean over ranks of the values each rank
// computed since the last synchronisation: a rank with no samples (whose running
// statistics never moved) sets nothing, a tiny share sets its part. With ranks that
// start from the same values, BatchNorm's running mean is then exactly that of
// single-device training on the whole batch. Without setBatch() every rank weighs
// the same.
void DistributedDataParallel::Impl::syncBuffers() {
  if (comm_.size() > 1 && !buffers_.empty()) {
    detail::averageCoalesced(comm_, buffers_, batchSet_ ? bufferWeight_ : 1.0);
  }
  bufferWeight_ = 0.0;
  weightAfterStep_ = 0.0;
  batchSet_ = false;
}

}  // namespace hddp
