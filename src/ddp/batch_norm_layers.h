// Plain torch::nn::BatchNorm layers in a model (private to the ddp layer): what
// convertSyncBatchNorm replaces and what DistributedDataParallel warns about.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/options/batchnorm.h>

#include <string>
#include <vector>

namespace hddp {
namespace ddp {

/// The options of a torch::nn::BatchNorm{1,2,3}d, or null for any other module.
const torch::nn::BatchNormOptions* plainBatchNormOptions(const torch::nn::Module& module);

/// The names (from `module`) of the plain BatchNorm layers under it that normalise with
/// their own batch's statistics: those in training mode, and those without running
/// statistics. Each layer once, in registration order.
std::vector<std::string> localBatchNormLayers(const torch::nn::Module& module);

}  // namespace ddp
}  // namespace hddp
