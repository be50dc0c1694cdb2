// DistributedDataParallel's implementation (internal to the ddp layer): the class
// behind the public API, shared by distributed_data_parallel.cpp (construction,
// hooks, buckets' launch, the API) and ddp_step_end.cpp (the end of a synchronized
// backward, and the bucket layout and its rebuild from the observed order).
#pragma once

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <sstream>
#include <unordered_map>

#include "core/gradient_capture.h"
#include "ddp/bucketing.h"
#include "ddp/coalesced.h"
#include "ddp/ready_hook.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/core/step_timer.h"
#include "hddp/ddp/distributed_data_parallel.h"

namespace hddp {
namespace ddp {

using Clock = std::chrono::steady_clock;

inline double secondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace ddp

class DistributedDataParallel::Impl {
 public:
  struct Param {
    at::Tensor tensor;
    std::string name;
    int bucket = -1;
    int64_t offset = 0;  // elements into the bucket's flat buffer
    bool ready = false;
    // .grad holds the sum over ranks of the last synchronized step, not yet cleared
    // by the user: the next step sends it divided by the world size (see holdOver).
    bool holdsReduced = false;
    unsigned preHookIndex = 0;
  };

  struct Bucket {
    std::vector<int> params;
    at::Tensor flat;
    std::function<void()> finish;  // the comm hook's, run after `work` completed
    int pending = 0;
    bool launched = false;
    Work work;
    ddp::Clock::time_point launchedAt;
    // Written by the backend's completion callback, which may run after wait()
    // returned (c10's Future wakes waiters before running callbacks): shared ownership.
    std::shared_ptr<std::atomic<int64_t>> completedAtNs;
  };

  Impl(std::shared_ptr<torch::nn::Module> module, Communicator& comm, DdpOptions options)
      : module_(std::move(module)), comm_(comm), options_(std::move(options)) {
    HDDP_CHECK(module_, "DistributedDataParallel needs a module, got a null pointer");
    HDDP_CHECK(options_.firstBucketBytes > 0 && options_.bucketCapBytes > 0,
               "DdpOptions bucket sizes must be positive, got firstBucketBytes=",
               options_.firstBucketBytes, " bucketCapBytes=", options_.bucketCapBytes);
    HDDP_CHECK(options_.bufferSyncInterval >= 1,
               "DdpOptions::bufferSyncInterval must be >= 1, got ", options_.bufferSyncInterval);
    HDDP_CHECK_AS(ConfigError, !options_.commHook || options_.compression == GradCompression::None,
                  "DdpOptions: set either compression or commHook, not both (compression is "
                  "a shorthand for commHook = compressedAllreduceHook(...))");
    hook_ = options_.commHook ? options_.commHook
            : options_.compression == GradCompression::None
                ? allreduceHook()
                : compressedAllreduceHook(
                      options_.compression == GradCompression::Fp16 ? at::kHalf : at::kBFloat16);
    std::unordered_map<const void*, std::string> seen;  // tied parameters: counted once
    for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
      const void* identity = item.value().unsafeGetTensorImpl();
      const auto known = seen.find(identity);
      if (known != seen.end()) {
        HDDP_LOG_DEBUG("ddp", "'", item.key(), "' is the same tensor as '", known->second,
                       "' (tied): synchronized once");
        continue;
      }
      seen.emplace(identity, item.key());
      if (item.value().requires_grad()) {
        Param p;
        p.tensor = item.value();
        p.name = item.key();
        params_.push_back(std::move(p));
      } else {
        frozen_.push_back(item.value());
        frozenNames_.push_back(item.key());
      }
    }
    for (const auto& item : module_->named_buffers(/*recurse=*/true)) {
      buffers_.push_back(item.value());
      bufferNames_.push_back(item.key());
    }
    weight_ = 1.0 / comm_.size();
    ddp::checkOneDevice(named(Naming::Bare));
    ddp::checkModelsAgree(comm_, named(Naming::WithKinds));
    if (options_.broadcastOnConstruction && comm_.size() > 1) {
      std::vector<at::Tensor> all;
      for (const auto& p : params_) {
        all.push_back(p.tensor);
      }
      all.insert(all.end(), frozen_.begin(), frozen_.end());
      all.insert(all.end(), buffers_.begin(), buffers_.end());
      detail::broadcastCoalesced(comm_, all, 0);
    }
    std::vector<int> order;
    for (int i = static_cast<int>(params_.size()) - 1; i >= 0; --i) {
      order.push_back(i);
    }
    buildBuckets(order);
    registerHooks();
    HDDP_LOG_SHARED("ddp", comm_.rank(), "wrapping ", params_.size(), " parameters (",
                    frozen_.size(), " frozen) and ", buffers_.size(), " buffers in ",
                    buckets_.size(), " bucket(s); rank ", comm_.rank(), "/", comm_.size());
  }

  ~Impl() {
    for (auto& p : params_) {
      try {
        auto& hook = torch::autograd::impl::post_acc_grad_hooks(p.tensor);
        if (auto* ours = dynamic_cast<ddp::ReadyHook*>(hook.get())) {
          hook = ours->takePrevious();
        }
        p.tensor.remove_hook(p.preHookIndex);
      } catch (const std::exception& e) {
        HDDP_LOG_WARN("ddp", "removing the hooks of '", p.name, "': ", e.what());
      }
    }
  }

  void setBatch(int64_t local, int64_t global) {
    HDDP_CHECK(global > 0, "setBatch: the global batch must be positive, got ", global);
    HDDP_CHECK(local >= 0 && local <= global, "setBatch: the local batch ", local,
               " must be between 0 and the global batch ", global);
    weight_ = static_cast<double>(local) / static_cast<double>(global);
    bufferWeight_ += weight_;
    batchSet_ = true;
    stepDone_ = false;  // a new step: finalize() synchronizes again
  }

  void setNoSync(bool on) { noSync_ = on; }
  bool noSync() const { return noSync_; }

  // ---- hooks -------------------------------------------------------------------

  void registerHooks() {
    for (size_t i = 0; i < params_.size(); ++i) {
      registerHook(static_cast<int>(i));
    }
  }

  void registerHook(int i) {
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
  void holdOver(Param& p) {
    if (!p.holdsReduced) {
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
  void densify(const Param& p, at::Tensor& grad) {
    if (!warnedSparse_) {
      warnedSparse_ = true;
      HDDP_LOG_WARN("ddp", "parameter '", p.name,
                    "' received a sparse gradient (e.g. Embedding with sparse=true); "
                    "DistributedDataParallel allreduces dense buckets, so sparse gradients are "
                    "made dense (same result, the full tensor's bytes on the wire)");
    }
    grad = grad.to_dense();
  }

  void onGradientReady(int index) {
    if (noSync_) {
      return;
    }
    if (!stepActive_) {
      beginStep();
      torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
    }
    markReady(index, /*duringBackward=*/true);
  }

  void beginStep() {
    stepActive_ = true;
    stepDone_ = false;
    nextBucket_ = 0;
    stats_ = DdpStepStats{};
    stats_.buckets = static_cast<int>(buckets_.size());
    abandonedLocally_ = false;
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
  at::Tensor sliceOf(const Param& p) {
    const Bucket& b = buckets_[p.bucket];
    at::Tensor alias = at::empty({0}, b.flat.options());
    alias.set_(b.flat.storage(), b.flat.storage_offset() + p.offset, p.tensor.sizes(),
               c10::contiguous_strides(p.tensor.sizes()));
    return alias;
  }

  void markReady(int index, bool duringBackward) {
    Param& p = params_[index];
    HDDP_CHECK(!p.ready, "parameter '", p.name, "' received a gradient twice in one step. ",
               "Is it used in two backward passes before the step ended? Use noSync() for "
               "gradient accumulation, and non-reentrant activation checkpointing.");
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
  void launchReadyBuckets(bool duringBackward) {
    while (nextBucket_ < static_cast<int>(buckets_.size()) && buckets_[nextBucket_].pending == 0) {
      Bucket& b = buckets_[nextBucket_];
      b.launchedAt = ddp::Clock::now();
      GradBucket bucket{nextBucket_, b.flat};
      CommHookResult sent = hook_(comm_, bucket);
      b.work = std::move(sent.work);
      b.finish = std::move(sent.finish);
      b.work.onCompletion(
          [done = b.completedAtNs] { done->store(ddp::Clock::now().time_since_epoch().count()); });
      b.launched = true;
      // "During backward": gradients of other parameters were still to come.
      if (duringBackward && readyCount_ < params_.size()) {
        ++stats_.bucketsLaunchedDuringBackward;
      }
      ++nextBucket_;
    }
  }

  // ---- end of step ----------------------------------------------------------------

  // This rank could not finish the step (out of memory in forward or backward): send
  // zeros for every gradient not yet sent, and a 1 in the status slot, so the step's
  // collectives complete on every rank and every rank learns the step failed. False
  // when it is too late (every bucket already sent).
  bool abandonStep() {
    HDDP_CHECK(!noSync_, "abandonStep() inside noSync(): nothing is being synchronized");
    if (!stepActive_) {
      beginStep();
    }
    if (nextBucket_ >= static_cast<int>(buckets_.size()) && !buckets_.empty()) {
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

  bool lastStepAbandoned() {
    if (buckets_.empty()) {
      return abandonedLocally_;
    }
    // The slot holds the sum over ranks after the last bucket's allreduce.
    return statusSlot().item<double>() > 0.5;
  }

  // The last element of the last bucket (launched last): 0 from every rank that
  // finished the step, 1 from a rank that abandoned it; summed by the allreduce.
  at::Tensor statusSlot() {
    const at::Tensor& flat = buckets_.back().flat;
    return flat.narrow(0, flat.numel() - 1, 1);
  }

  // The end of a synchronized backward (queued on the autograd engine).
  void finalize();

  // Buffers become the sample-weighted mean over ranks of the values each rank
  // computed since the last synchronisation: a rank with no samples (whose running
  // statistics never moved) sets nothing, a tiny share sets its part. With ranks that
  // start from the same values, BatchNorm's running mean is then exactly that of
  // single-device training on the whole batch. Without setBatch() every rank weighs
  // the same.
  void syncBuffers() {
    if (comm_.size() > 1 && !buffers_.empty()) {
      detail::averageCoalesced(comm_, buffers_, batchSet_ ? bufferWeight_ : 1.0);
    }
    bufferWeight_ = 0.0;
    batchSet_ = false;
  }

  // ---- buckets ----------------------------------------------------------------------

  void buildBuckets(const std::vector<int>& order);

  void rebuildFromObservedOrder();

  // ---- construction checks ----------------------------------------------------------

  enum class Naming {
    /// Parameters and frozen parameters by their names (the device check).
    Bare,
    /// Every tensor, buffers included, as "param <name>", "frozen <name>", "buffer
    /// <name>" (the model signature).
    WithKinds,
  };
  std::vector<std::pair<std::string, at::Tensor>> named(Naming naming) const {
    const bool kinds = naming == Naming::WithKinds;
    const bool withBuffers = kinds;
    std::vector<std::pair<std::string, at::Tensor>> out;
    auto add = [&](const char* kind, const std::string& name, const at::Tensor& t) {
      out.emplace_back(kinds ? std::string(kind) + " " + name : name, t);
    };
    for (const auto& p : params_) {
      add("param", p.name, p.tensor);
    }
    for (size_t i = 0; i < frozen_.size(); ++i) {
      add("frozen", frozenNames_[i], frozen_[i]);
    }
    for (size_t i = 0; withBuffers && i < buffers_.size(); ++i) {
      add("buffer", bufferNames_[i], buffers_[i]);
    }
    return out;
  }

  std::vector<std::vector<std::string>> layout() const {
    std::vector<std::vector<std::string>> out;
    for (const auto& b : buckets_) {
      out.emplace_back();
      for (int index : b.params) {
        out.back().push_back(params_[index].name);
      }
    }
    return out;
  }

  std::shared_ptr<torch::nn::Module> module_;
  Communicator& comm_;
  DdpOptions options_;
  CommHook hook_;  // what is sent for each bucket
  std::vector<Param> params_;
  std::vector<at::Tensor> frozen_;
  std::vector<std::string> frozenNames_;
  std::vector<at::Tensor> buffers_;
  std::vector<std::string> bufferNames_;
  std::vector<Bucket> buckets_;
  double weight_ = 1.0;
  double bufferWeight_ = 0.0;  // sum of local/global since the buffers were last synced
  bool batchSet_ = false;      // setBatch() was called since then
  bool noSync_ = false;
  bool stepActive_ = false;
  bool stepDone_ = false;  // the last step was synchronized; no new one has started
  bool warnedSparse_ = false;
  bool abandoning_ = false;
  bool abandonedLocally_ = false;
  int nextBucket_ = 0;
  size_t readyCount_ = 0;
  int64_t step_ = 0;
  bool recordOrder_ = true;
  std::vector<int> readyOrder_;
  DdpStepStats stats_;
  StepTimer* timer_ = nullptr;
};

}  // namespace hddp
