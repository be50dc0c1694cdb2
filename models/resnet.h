// ResNets for the examples and benchmarks.
//   CIFAR-style (He et al. 2016, section 4.2): ResNet-20/32/56, 3 stages of 16/32/64.
//   ResNet-9 (Page 2018, the DAWNBench CIFAR-10 net) at a quarter of its width, for
//   small images on CPUs: 8 conv layers, 2 residuals, max-pools.
//   ImageNet-style: ResNet-18/34 (basic blocks), ResNet-50 (bottlenecks); with a CIFAR
//   stem (3x3 conv, no max-pool) for inputs of 64 px or less, the ImageNet stem
//   (7x7/2 conv + max-pool) otherwise.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <string>

namespace hddp {
namespace models {

struct ResNetOptions {
  /// resnet9, resnet20, resnet32, resnet56, resnet18, resnet34 or resnet50.
  std::string arch = "resnet18";
  int64_t inChannels = 3;
  int64_t numClasses = 10;
  /// Input height/width; <= 64 selects the CIFAR stem for resnet18/34/50.
  int64_t imageSize = 32;
  /// Use hddp::SyncBatchNorm instead of torch::nn::BatchNorm2d (attach the
  /// communicator with hddp::convertSyncBatchNorm(*model, comm)). Default false.
  bool syncBatchNorm = false;
  /// Recompute each residual block in backward (hddp::checkpoint): finer than whole
  /// stages, which on CPU cost 25% speed for 11% memory (DESIGN.md). Default false.
  bool checkpointActivations = false;
};

class ResNetImpl : public torch::nn::Module {
 public:
  explicit ResNetImpl(const ResNetOptions& options);
  torch::Tensor forward(torch::Tensor x);
  /// The network as stages (stem, stages..., head), for activation checkpointing.
  const std::vector<torch::nn::Sequential>& stages() const { return stages_; }

 private:
  void buildResNet9(const ResNetOptions& options);
  void initConvs();

  std::vector<torch::nn::Sequential> stages_;
  bool checkpoint_ = false;
  bool maxPoolHead_ = false;
  torch::nn::Linear fc_{nullptr};
};
TORCH_MODULE(ResNet);

/// True when `arch` names a supported ResNet.
bool isResNetArch(const std::string& arch);

}  // namespace models
}  // namespace hddp
