// ResNets for the examples and benchmarks.
//   CIFAR-style (He et al. 2016, section 4.2): ResNet-20/32/56, 3 stages of 16/32/64.
//   ResNet-9 (Page 2018, the DAWNBench CIFAR-10 net) at a quarter of its width, for
//   small images on CPUs: 8 conv layers, 2 residuals, max-pools.
//   ImageNet-style: ResNet-18/34 (basic blocks), ResNet-50 (bottlenecks); by default
//   with a CIFAR stem (3x3 conv, no max-pool) for inputs of 64 px or less, torchvision's
//   ImageNet stem (7x7/2 conv + max-pool) otherwise; ResNetOptions::stem picks either.
// Names. ResNet-18/34/50 have torchvision's structure and parameter names (conv1, bn1,
// layer1.0.conv1, layer2.0.downsample.0, fc; v1.5 bottlenecks with the stride on the
// 3x3 conv), so with the ImageNet stem a state dict loads both ways between them and
// torchvision.models.resnet18/34/50(num_classes=...) (hddp/train/state_dict.h). With
// the CIFAR stem only conv1's shape differs (3x3 against 7x7).
// ResNet-20/32/56 and ResNet-9 keep their own names: stem.0 (conv), stem.1 (norm),
// stageN.i.body.K (a block's conv/norm layers in order), stageN.i.shortcut.{0,1}, fc;
// ResNet-9's residuals are stageN.2.body.K.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <string>

namespace hddp {
namespace models {

/// The first layers of ResNet-18/34/50.
enum class ResNetStem {
  /// Cifar for images of 64 px or less, Torchvision above.
  Auto,
  /// A 3x3 stride-1 conv1 and no max-pool: small images keep their resolution.
  Cifar,
  /// torchvision's: a 7x7 stride-2 conv1 and a 3x3 stride-2 max-pool, so that a state
  /// dict of torchvision.models.resnet18/34/50 loads unchanged, at any image size.
  Torchvision,
};

/// "auto", "cifar" or "torchvision" (hddp::Error naming the choices otherwise).
ResNetStem parseResNetStem(const std::string& name);

struct ResNetOptions {
  /// resnet9, resnet20, resnet32, resnet56, resnet18, resnet34 or resnet50.
  std::string arch = "resnet18";
  int64_t inChannels = 3;
  int64_t numClasses = 10;
  /// Input height/width; <= 64 selects the CIFAR stem for resnet18/34/50 under
  /// ResNetStem::Auto.
  int64_t imageSize = 32;
  /// ResNet-18/34/50's stem. Default Auto (by imageSize). ResNet-9/20/32/56 have their
  /// own 3x3 stem: Torchvision is an error for them, Cifar and Auto the same.
  ResNetStem stem = ResNetStem::Auto;
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
  /// The residual stages (layer1..4, or stem and stage1..N), for activation checkpointing.
  const std::vector<torch::nn::Sequential>& stages() const { return stages_; }

 private:
  void buildResNet9(const ResNetOptions& options);
  void initConvs();

  std::vector<torch::nn::Sequential> stages_;
  bool checkpoint_ = false;
  bool maxPoolHead_ = false;
  bool torchvision_ = false;  // ResNet-18/34/50: torchvision's names and stem
  bool stemMaxPool_ = false;
  torch::nn::Conv2d conv1_{nullptr};
  torch::nn::AnyModule bn1_;
  torch::nn::Linear fc_{nullptr};
};
TORCH_MODULE(ResNet);

/// True when `arch` names a supported ResNet.
bool isResNetArch(const std::string& arch);

}  // namespace models
}  // namespace hddp
