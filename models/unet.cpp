#include "unet.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/torch.h>

#include "hddp/checkpoint/checkpoint.h"
#include "hddp/core/error.h"

namespace hddp {
namespace models {
namespace {

namespace nn = torch::nn;

nn::Sequential doubleConv(int64_t in, int64_t out, bool bn) {
  nn::Sequential s;
  for (int i = 0; i < 2; ++i) {
    s->push_back(nn::Conv2d(nn::Conv2dOptions(i == 0 ? in : out, out, 3).padding(1).bias(!bn)));
    if (bn) {
      s->push_back(nn::BatchNorm2d(out));
    }
    s->push_back(nn::ReLU(true));
  }
  return s;
}

}  // namespace

UNetImpl::UNetImpl(const UNetOptions& o) : options_(o) {
  HDDP_CHECK(
      o.depth >= 1 && o.depth <= 8 && o.baseWidth > 0 && o.inChannels > 0 && o.numClasses > 0,
      "bad U-Net options: depth ", o.depth, ", base width ", o.baseWidth, ", ", o.inChannels,
      " input channels, ", o.numClasses, " classes");
  int64_t in = o.inChannels;
  for (int64_t level = 0; level < o.depth; ++level) {
    const int64_t width = o.baseWidth << level;
    down_.push_back(
        register_module("down" + std::to_string(level), doubleConv(in, width, o.batchNorm)));
    in = width;
  }
  bottom_ = register_module("bottom", doubleConv(in, in * 2, o.batchNorm));
  in *= 2;
  for (int64_t level = o.depth - 1; level >= 0; --level) {
    const int64_t width = o.baseWidth << level;
    up_.push_back(
        register_module("up" + std::to_string(level),
                        nn::ConvTranspose2d(nn::ConvTranspose2dOptions(in, width, 2).stride(2))));
    decode_.push_back(register_module("decode" + std::to_string(level),
                                      doubleConv(width * 2, width, o.batchNorm)));
    in = width;
  }
  head_ = register_module("head", nn::Conv2d(nn::Conv2dOptions(in, o.numClasses, 1)));
}

torch::Tensor UNetImpl::runBlock(nn::Sequential& block, const torch::Tensor& x) {
  if (!options_.checkpointActivations || !is_training()) {
    return block->forward(x);
  }
  return checkpoint(
      [&block](const std::vector<torch::Tensor>& in) {
        return std::vector<torch::Tensor>{block->forward(in[0])};
      },
      {x}, block->parameters())[0];
}

torch::Tensor UNetImpl::forward(torch::Tensor x) {
  const int64_t multiple = int64_t(1) << options_.depth;
  HDDP_CHECK(x.dim() == 4 && x.size(2) % multiple == 0 && x.size(3) % multiple == 0,
             "U-Net of depth ", options_.depth,
             " needs (N, C, H, W) input with H and W divisible by ", multiple, ", got ", x.sizes());
  std::vector<torch::Tensor> skips;
  for (auto& block : down_) {
    x = runBlock(block, x);
    skips.push_back(x);
    x = torch::max_pool2d(x, 2);
  }
  x = runBlock(bottom_, x);
  for (size_t i = 0; i < up_.size(); ++i) {
    x = up_[i]->forward(x);
    x = runBlock(decode_[i], torch::cat({x, skips[skips.size() - 1 - i]}, 1));
  }
  return head_->forward(x);
}

}  // namespace models
}  // namespace hddp
