// Activation checkpointing (LibTorch's C++ API has none: pytorch#52744).
//
//   auto outs = hddp::checkpoint([&](const std::vector<at::Tensor>& in) {
//     return std::vector<at::Tensor>{block->forward(in[0])};
//   }, {x}, block->parameters());
//
// Forward runs `fn` without recording a graph and keeps only the inputs; backward
// re-runs `fn` with gradients enabled and back-propagates through it. The RNG states
// (CPU, and the CUDA devices of the inputs) and the autocast state of the forward are
// restored for the recomputation, so dropout draws the same masks and results are
// bit-identical to the plain model.
//
// Parameters are passed explicitly: their gradients then flow through the outer
// backward into their own accumulators, so DistributedDataParallel's hooks see them
// exactly as without checkpointing. A parameter `fn` uses but that is not passed is
// reported (its gradient would otherwise be lost). Layers with running statistics
// (BatchNorm) update them twice, in forward and in the recomputation, as in PyTorch.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <vector>

namespace hddp {

using CheckpointFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// Runs `fn(inputs)` with activation checkpointing. `parameters`: every tensor
/// requiring grad that `fn` uses besides `inputs` (e.g. module->parameters()).
/// Throws hddp::Error when nothing requires grad (the call would be pointless and the
/// gradient lost) and, in backward, when `fn` used an unlisted parameter.
std::vector<at::Tensor> checkpoint(const CheckpointFunction& fn,
                                   const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& parameters = {});

/// A Sequential split into `segments` contiguous segments; in training mode all but
/// the last are checkpointed (as torch.utils.checkpoint.checkpoint_sequential).
/// Its modules must take and return one tensor.
class CheckpointedSequentialImpl : public torch::nn::Cloneable<CheckpointedSequentialImpl> {
 public:
  CheckpointedSequentialImpl(torch::nn::Sequential sequential, int segments);
  void reset() override;
  at::Tensor forward(const at::Tensor& input);
  int segments() const { return segments_; }

 private:
  at::Tensor runRange(size_t begin, size_t end, const at::Tensor& x);
  torch::nn::Sequential sequential_;
  int segments_;
};
TORCH_MODULE(CheckpointedSequential);

}  // namespace hddp
