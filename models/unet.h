// A configurable 2D U-Net (Ronneberger et al. 2015) for segmentation: `depth` levels of
// two 3x3 convolutions (with BatchNorm or none), max-pool down, transposed-conv up,
// skip connections by concatenation, a 1x1 head to `numClasses` logits per pixel.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>

#include <vector>

namespace hddp {
namespace models {

struct UNetOptions {
  int64_t inChannels = 1;
  int64_t numClasses = 2;
  /// Down-sampling levels. Default 4. Input sides must be divisible by 2^depth.
  int64_t depth = 4;
  /// Channels of the first level, doubled per level. Default 32.
  int64_t baseWidth = 32;
  bool batchNorm = true;
  /// Recompute each encoder/decoder block in backward (hddp::checkpoint). Default false.
  bool checkpointActivations = false;
};

class UNetImpl : public torch::nn::Module {
 public:
  explicit UNetImpl(const UNetOptions& options);
  torch::Tensor forward(torch::Tensor x);
  const UNetOptions& options() const { return options_; }

 private:
  torch::Tensor runBlock(torch::nn::Sequential& block, const torch::Tensor& x);
  UNetOptions options_;
  std::vector<torch::nn::Sequential> down_;
  torch::nn::Sequential bottom_{nullptr};
  std::vector<torch::nn::ConvTranspose2d> up_;
  std::vector<torch::nn::Sequential> decode_;
  torch::nn::Conv2d head_{nullptr};
};
TORCH_MODULE(UNet);

}  // namespace models
}  // namespace hddp
