// SyncBatchNorm for C++ (PyTorch has it only in Python), for unequal local batches.
//
// In training mode the batch statistics are those of the global batch: each rank
// allreduces its per-channel sum, sum of squares and element count (one collective in
// forward, one in backward), so the mean and variance are weighted by each rank's
// sample count. With hddp's gradient weighting (DistributedDataParallel::setBatch), a
// BatchNorm model trained on any split then matches single-device training on the
// global batch, training-mode statistics included. Running statistics are updated from
// the global statistics, so they are identical on all ranks. Eval mode is plain
// BatchNorm with the running statistics, and without them (trackRunningStats false) each
// rank's own batch: eval mode runs no collective, as PyTorch's SyncBatchNorm.
//
// Contract: every rank runs forward and backward through each SyncBatchNorm layer in
// every training step (a rank needs at least one sample; the collectives must match).
// The backward assumes each rank's loss is the mean over its local samples, as
// DistributedDataParallel's weighting does. Parameter and buffer names match
// torch::nn::BatchNorm*d, so state is interchangeable.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <vector>

#include "hddp/comm/communicator.h"

namespace hddp {

struct SyncBatchNormOptions {
  explicit SyncBatchNormOptions(int64_t numFeatures) : numFeatures(numFeatures) {}
  int64_t numFeatures;
  /// Default 1e-5, as torch::nn::BatchNorm.
  double eps = 1e-5;
  /// Default 0.1, as torch::nn::BatchNorm.
  double momentum = 0.1;
  /// Learnable weight and bias. Default true.
  bool affine = true;
  /// Keep running mean/variance. Default true.
  bool trackRunningStats = true;
};

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  /// `communicator` may be null until setCommunicator(); without one (or with one
  /// rank) the layer behaves as plain BatchNorm.
  explicit SyncBatchNormImpl(SyncBatchNormOptions options, Communicator* communicator = nullptr);
  explicit SyncBatchNormImpl(int64_t numFeatures)
      : SyncBatchNormImpl(SyncBatchNormOptions(numFeatures)) {}
  /// From torch::nn::BatchNorm{1,2,3}dOptions, so that a member field declared
  /// `torch::nn::BatchNorm2d bn` can be declared `hddp::SyncBatchNorm bn` with its
  /// constructor argument unchanged. A momentum of nullopt (torch's cumulative moving
  /// average) is a ConfigError: SyncBatchNorm keeps an exponential one.
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options,
                             Communicator* communicator = nullptr);

  void reset() override;
  /// Input (N, C, ...) with C = numFeatures.
  at::Tensor forward(const at::Tensor& input);

  void setCommunicator(Communicator* communicator) { communicator_ = communicator; }
  /// The communicator its statistics are summed over (null: none yet).
  Communicator* communicator() const { return communicator_; }
  const SyncBatchNormOptions& options() const { return options_; }

  at::Tensor weight;
  at::Tensor bias;
  at::Tensor running_mean;
  at::Tensor running_var;
  at::Tensor num_batches_tracked;

 private:
  SyncBatchNormOptions options_;
  Communicator* communicator_;
};
TORCH_MODULE(SyncBatchNorm);

/// Attaches `communicator` to every SyncBatchNorm under `module`, and replaces every
/// torch::nn::BatchNorm{1,2,3}d under it by a SyncBatchNorm with the same options,
/// parameters, buffers, device, dtype, requires_grad and training mode; returns the
/// registered names of the replaced layers. A layer is replaced where the model holds it:
/// in its parent's module registry (register_module) and in each torch::nn::Sequential
/// entry that holds the same object, so a Sequential's forward calls the SyncBatchNorm
/// (pytorch/examples' dcgan discriminator, a ResNet's stages).
///
/// A member field typed torch::nn::BatchNorm2d (`bn = register_module("bn",
/// torch::nn::BatchNorm2d(64));`) cannot be converted by any library: the field holds its
/// own pointer, its type admits only torch's BatchNorm, and that forward is not virtual,
/// so the model's `bn(x)` would keep running per-rank BatchNorm whatever the registry
/// holds. Declare the field `hddp::SyncBatchNorm bn{nullptr};` instead (the same
/// constructor argument, an int or a BatchNorm2dOptions, and the same state-dict names;
/// without a communicator or on one rank it is plain BatchNorm); this function then
/// attaches the communicator. When anything besides registries and Sequential entries
/// still holds a BatchNorm (a field, a ModuleList, a std::vector, an AnyModule), or its
/// momentum is nullopt, hddp::ConfigError names those layers and says this, and nothing
/// is converted or attached. Call it before building DistributedDataParallel and the
/// optimizer: they hold the parameters the conversion replaces.
std::vector<std::string> convertSyncBatchNorm(torch::nn::Module& module,
                                              Communicator& communicator);

}  // namespace hddp
