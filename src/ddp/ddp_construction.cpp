// DistributedDataParallel::Impl (ddp/ddp_impl.h): construction, the model checks and
// the removal of the hooks.
#include <torch/csrc/autograd/variable.h>

#include <unordered_map>

#include "ddp/batch_norm_layers.h"
#include "ddp/bucketing.h"
#include "ddp/coalesced.h"
#include "ddp/ddp_impl.h"
#include "ddp/ready_hook.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/sync_batch_norm.h"

namespace hddp {

DistributedDataParallel::Impl::Impl(std::shared_ptr<torch::nn::Module> module, Communicator& comm,
                                    DdpOptions options)
    : module_(std::move(module)), comm_(comm), options_(std::move(options)) {
  HDDP_CHECK(module_, "DistributedDataParallel needs a module, got a null pointer");
  HDDP_CHECK(options_.firstBucketBytes > 0 && options_.bucketCapBytes > 0,
             "DdpOptions bucket sizes must be positive, got firstBucketBytes=",
             options_.firstBucketBytes, " bucketCapBytes=", options_.bucketCapBytes);
  HDDP_CHECK(options_.bufferSyncInterval >= 1, "DdpOptions::bufferSyncInterval must be >= 1, got ",
             options_.bufferSyncInterval);
  HDDP_CHECK_AS(
      ConfigError, options_.compression != GradCompression::Auto,
      "DdpOptions::compression Auto is resolved by the Trainer; a DistributedDataParallel "
      "of your own takes a choice (hddp::chooseCompression prices them for a link)");
  HDDP_CHECK_AS(ConfigError, !options_.commHook || options_.compression == GradCompression::None,
                "DdpOptions: set either compression or commHook, not both (compression is "
                "a shorthand for commHook = compressedAllreduceHook(...))");
  installHook();
  warnOfLocalBatchNorm();
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
    // In chunks of a bucket: a small card need not hold a second copy of the model.
    detail::broadcastCoalesced(comm_, all, 0, options_.bucketCapBytes);
  }
  std::vector<int> order;
  for (int i = static_cast<int>(params_.size()) - 1; i >= 0; --i) {
    order.push_back(i);
  }
  buildBuckets(order);
  registerHooks();
  HDDP_LOG_SHARED("ddp", comm_.rank(), "wrapping ", params_.size(), " parameters (", frozen_.size(),
                  " frozen) and ", buffers_.size(), " buffers in ", buckets_.size(),
                  " bucket(s); rank ", comm_.rank(), "/", comm_.size());
}

DistributedDataParallel::Impl::~Impl() {
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

std::vector<std::pair<std::string, at::Tensor>> DistributedDataParallel::Impl::named(
    Naming naming) const {
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

std::vector<std::vector<std::string>> DistributedDataParallel::Impl::layout() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& b : buckets_) {
    out.emplace_back();
    for (int index : b.params) {
      out.back().push_back(params_[index].name);
    }
  }
  return out;
}

void DistributedDataParallel::Impl::installHook() {
  // Built first, kept only when every part is made (PowerSgdState checks its options).
  std::shared_ptr<PowerSgdState> powerSgd;
  CommHook hook;
  if (options_.commHook) {
    hook = options_.commHook;
  } else if (options_.compression == GradCompression::PowerSgd) {
    powerSgd = std::make_shared<PowerSgdState>(options_.powerSgd);
    hook = powerSgdHook(powerSgd);
  } else if (options_.compression == GradCompression::None) {
    hook = allreduceHook();
  } else {
    hook = compressedAllreduceHook(options_.compression == GradCompression::Fp16 ? at::kHalf
                                                                                 : at::kBFloat16);
  }
  hookSumsWholeBuffer_ = !options_.commHook && options_.compression != GradCompression::PowerSgd;
  powerSgd_ = std::move(powerSgd);
  hook_ = std::move(hook);
  statusWire_ = at::Tensor();  // nothing of an earlier hook's status is left to copy back
  statusWork_ = Work();
}

// Plain BatchNorm in training mode under unequal shares: exactness lost without a word
// unless this says so (DdpOptions::allowLocalBatchNorm).
void DistributedDataParallel::Impl::warnOfLocalBatchNorm() const {
  if (options_.allowLocalBatchNorm || comm_.size() < 2) {
    return;
  }
  // A SyncBatchNorm declared as a field but never given this group's communicator
  // (convertSyncBatchNorm attaches it) normalises each rank's own share too.
  std::string detached;
  size_t detachedCount = 0;
  const auto noteDetached = [&](const torch::nn::Module& module, const std::string& name) {
    const auto* sync = dynamic_cast<const SyncBatchNormImpl*>(&module);
    if (sync != nullptr &&
        (sync->communicator() == nullptr || sync->communicator()->size() != comm_.size())) {
      if (detachedCount++ < 4) {
        detached += (detached.empty() ? "'" : ", '") + name + "'";
      }
    }
  };
  noteDetached(*module_, "(the model)");  // a module on the stack has no shared_ptr to it
  for (const auto& item : module_->named_modules("", /*include_self=*/false)) {
    noteDetached(*item.value(), item.key());
  }
  if (detachedCount > 0) {
    HDDP_LOG("ddp", comm_.rank() == 0 ? log::Level::Warn : log::Level::Debug, detachedCount,
             " hddp::SyncBatchNorm layer(s) have no communicator of this ", comm_.size(),
             "-rank group (", detached, detachedCount > 4 ? ", ..." : "",
             "): each normalises its own rank's share. Call hddp::convertSyncBatchNorm(*model, "
             "comm) (or setCommunicator) before wrapping the model");
  }
  const auto names = ddp::localBatchNormLayers(*module_);
  if (names.empty()) {
    return;
  }
  std::string listed;
  for (size_t i = 0; i < names.size() && i < 4; ++i) {
    listed += (i ? ", '" : "'") + names[i] + "'";
  }
  if (names.size() > 4) {
    listed += ", ... (" + std::to_string(names.size()) + " in all)";
  }
  HDDP_LOG("ddp", comm_.rank() == 0 ? log::Level::Warn : log::Level::Debug, names.size(),
           " torch::nn::BatchNorm layer(s) in training mode normalise each rank's own share (",
           listed,
           "): with unequal shares training is then not single-device training on the global "
           "batch. Use hddp::SyncBatchNorm (hddp::convertSyncBatchNorm(*model, comm) before "
           "wrapping the model), or set DdpOptions::allowLocalBatchNorm = true if per-rank "
           "statistics are intended");
}

// With findUnusedParameters the ranks may use different parameters, so a bucket can be
// ready during backward on one rank and only at its end on another. A SyncBatchNorm
// sums its statistics in backward: were a bucket sent during backward, one rank's
// bucket would meet another rank's SyncBatchNorm sum (silently wrong sums when their
// sizes agree, a hang when not). The buckets then wait for the end of backward and go
// out in index order there on every rank (no overlap of sending with backward). Checked
// at each step, so a conversion after construction counts too.
bool DistributedDataParallel::Impl::holdBucketsUntilBackwardEnds() {
  if (!options_.findUnusedParameters || comm_.size() < 2) {
    return false;
  }
  bool found = false;
  for (const auto& module : module_->modules(/*include_self=*/true)) {
    const auto* sync = dynamic_cast<const SyncBatchNormImpl*>(module.get());
    if (sync && sync->communicator() && sync->communicator()->size() > 1) {
      found = true;
      break;
    }
  }
  if (found && !warnedHoldBuckets_) {
    warnedHoldBuckets_ = true;
    HDDP_LOG_INFO("ddp",
                  "findUnusedParameters beside SyncBatchNorm: gradient buckets are sent when "
                  "backward ends, not during it (ranks that use different parameters would "
                  "otherwise cross SyncBatchNorm's collectives in backward)");
  }
  return found;
}

}  // namespace hddp
