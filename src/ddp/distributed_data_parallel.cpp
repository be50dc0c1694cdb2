#include "hddp/ddp/distributed_data_parallel.h"

#include "ddp/ddp_impl.h"

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

namespace detail {

bool DdpAccess::abandonStep(DistributedDataParallel& ddp) { return ddp.impl_->abandonStep(); }
bool DdpAccess::lastStepAbandoned(DistributedDataParallel& ddp) {
  return ddp.impl_->lastStepAbandoned();
}
const std::vector<BucketTiming>& DdpAccess::bucketTimes(const DistributedDataParallel& ddp) {
  return ddp.impl_->bucketTimes_;
}

}  // namespace detail

}  // namespace hddp
