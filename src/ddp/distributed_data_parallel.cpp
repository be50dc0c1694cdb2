#include "hddp/ddp/distributed_data_parallel.h"

#include <unordered_map>

#include "ddp/ddp_impl.h"
#include "hddp/core/error.h"

namespace hddp {

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 Communicator& communicator, DdpOptions options)
    : impl_(std::make_unique<Impl>(std::move(module), communicator, std::move(options))) {}

DistributedDataParallel::~DistributedDataParallel() = default;

void DistributedDataParallel::setBatch(int64_t localBatch, int64_t globalBatch) {
  impl_->setBatch(localBatch, globalBatch);
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp)
    : ddp_(ddp), previous_(ddp.impl_->noSync()) {
  ddp_.impl_->setNoSync(true);
}

DistributedDataParallel::NoSyncGuard::~NoSyncGuard() { ddp_.impl_->setNoSync(previous_); }

void DistributedDataParallel::finalize() { impl_->finalize(); }
std::vector<at::Tensor> DistributedDataParallel::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& p : impl_->params_) {
    out.push_back(p.tensor);
  }
  return out;
}
std::vector<std::string> DistributedDataParallel::parameterNames() const {
  std::vector<std::string> out;
  for (const auto& p : impl_->params_) {
    out.push_back(p.name);
  }
  return out;
}
void DistributedDataParallel::setGradientOwners(std::vector<int> owners, bool releaseForeign) {
  impl_->setGradientOwners(std::move(owners), releaseForeign);
}
void DistributedDataParallel::syncBuffers() { impl_->syncBuffers(); }
torch::nn::Module& DistributedDataParallel::module() { return *impl_->module_; }
const std::shared_ptr<torch::nn::Module>& DistributedDataParallel::modulePtr() const {
  return impl_->module_;
}
Communicator& DistributedDataParallel::communicator() { return impl_->comm_; }
const DdpOptions& DistributedDataParallel::options() const { return impl_->options_; }
std::vector<std::vector<std::string>> DistributedDataParallel::bucketLayout() const {
  return impl_->layout();
}
const DdpStepStats& DistributedDataParallel::lastStepStats() const { return impl_->stats_; }
const std::shared_ptr<PowerSgdState>& DistributedDataParallel::powerSgdState() const {
  return impl_->powerSgd_;
}

void DistributedDataParallel::setCompression(GradCompression compression,
                                             const PowerSgdOptions& powerSgd) {
  Impl& d = *impl_;
  HDDP_CHECK_AS(ConfigError, compression != GradCompression::Auto,
                "setCompression: Auto is not a choice (hddp::chooseCompression makes one)");
  HDDP_CHECK_AS(ConfigError, !d.options_.commHook,
                "setCompression: DdpOptions::commHook is set; compression is a shorthand for a "
                "hook, so set one or the other");
  HDDP_CHECK_AS(ConfigError, d.step_ == 0 && !d.stepActive_,
                "setCompression: the compression is set before the first step, and ", d.step_,
                " steps have run");
  HDDP_CHECK_AS(ConfigError, !d.sharded(),
                "setCompression: gradient owners are set (ZeRO); buckets are reduced to their "
                "owners and cannot be compressed or sent another way");
  const DdpOptions before = d.options_;
  d.options_.compression = compression;
  d.options_.powerSgd = powerSgd;
  try {
    d.installHook();
  } catch (...) {
    d.options_ = before;  // the hook in place stays, and so do the options it was made of
    throw;
  }
}

bool DistributedDataParallel::abandonStep() { return impl_->abandonStep(); }
bool DistributedDataParallel::lastStepAbandoned() { return impl_->lastStepAbandoned(); }
void DistributedDataParallel::putBackStepBuffers() { impl_->putBackStepBuffers(); }

std::vector<std::string> DistributedDataParallel::bucketOrder() const {
  std::vector<std::string> names;
  for (const auto& bucket : impl_->layout()) {
    names.insert(names.end(), bucket.begin(), bucket.end());
  }
  return names;
}

bool DistributedDataParallel::setBucketOrder(const std::vector<std::string>& names) {
  auto& impl = *impl_;
  HDDP_CHECK_AS(ConfigError, !impl.stepActive_,
                "setBucketOrder: a step is under way (its backward began sending gradients and "
                "it was neither finished nor abandoned); call it between steps, on every rank");
  std::unordered_map<std::string, int> index;
  for (size_t i = 0; i < impl.params_.size(); ++i) {
    index.emplace(impl.params_[i].name, static_cast<int>(i));
  }
  std::vector<int> order;
  std::vector<bool> seen(impl.params_.size(), false);
  for (const auto& name : names) {
    const auto it = index.find(name);
    if (it == index.end() || seen[static_cast<size_t>(it->second)]) {
      return false;
    }
    seen[static_cast<size_t>(it->second)] = true;
    order.push_back(it->second);
  }
  if (order.size() != impl.params_.size()) {
    return false;
  }
  impl.buildBuckets(order);
  impl.recordOrder_ = false;
  return true;
}

const std::vector<BucketTiming>& DistributedDataParallel::lastStepBucketTimes() const {
  return impl_->bucketTimes_;
}

}  // namespace hddp
