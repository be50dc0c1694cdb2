// What a training step changes before it is known to stand, kept so that a step that is
// abandoned (some rank ran out of memory; the step is repeated under a new split:
// hddp/train/out_of_memory.h) or skipped (the GradScaler's overflow) leaves no trace. The forward
// updates normalisation statistics (BatchNorm's running mean and variance, num_batches_tracked) and
// draws from the random generators (dropout); the optimizer, the scaler and the sampler are not
// touched before the step stands, and PowerSGD's memories are undone by
// PowerSgdState::discardStep().
//
// Thread safety: used from the training thread only.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <vector>

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace hddp {

class StepRollback {
 public:
  /// Keeps `model`'s buffers (referenced, not owned: the model outlives this) and the
  /// random generators of the host and of `device`.
  StepRollback(torch::nn::Module& model, c10::Device device);

  /// Before the step's forward: copies the buffers into storage kept from step to step
  /// (one multi-tensor copy) and the generators' states.
  void capture();
  /// After an abandoned step: the buffers and generators as capture() saw them. Does
  /// nothing when nothing was captured since the last restore.
  void restore();

 private:
  torch::nn::Module& model_;
  c10::Device device_;
  std::vector<at::Tensor> buffers_;
  std::vector<at::Tensor> saved_;
  at::Tensor hostGenerator_;
  at::Tensor deviceGenerator_;
  bool captured_ = false;
};

}  // namespace hddp
