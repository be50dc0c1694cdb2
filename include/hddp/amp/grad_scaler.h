// GradScaler: dynamic loss scaling for float16 training, with PyTorch's semantics and
// defaults (torch.amp.GradScaler), which LibTorch's C++ API lacks.
//
//   hddp::GradScaler scaler(hddp::GradScalerOptions{}, ctx.communicator.get());
//   {
//     hddp::AutocastGuard amp(c10::kCUDA);                 // fp16 forward
//     loss = criterion(model->forward(x), y);
//   }
//   scaler.scale(loss).backward();
//   scaler.unscale(optimizer);                           // optional: before clipping
//   torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
//   scaler.step(optimizer);                              // skipped on inf/NaN gradients
//   scaler.update();                                     // backoff x0.5 or growth x2
//
// With a communicator, the found-inf flag is allreduced (max) so every rank skips or
// steps together. (After DistributedDataParallel's allreduce the gradients are already
// identical on all ranks; the flag allreduce also covers ranks whose own unscaling
// overflowed, at the cost of one 4-byte collective per step.) Uses LibTorch's native
// kernels (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_) where the
// device has them, plain tensor ops otherwise. bfloat16 autocast needs no scaler; a
// disabled scaler passes everything through.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>

#include "hddp/comm/communicator.h"

namespace torch {
namespace optim {
class Optimizer;
}  // namespace optim
namespace serialize {
class InputArchive;
class OutputArchive;
}  // namespace serialize
}  // namespace torch

namespace hddp {

struct GradScalerOptions {
  /// Default 2^16, as PyTorch.
  double initScale = 65536.0;
  /// Default 2.0, as PyTorch.
  double growthFactor = 2.0;
  /// Default 0.5, as PyTorch.
  double backoffFactor = 0.5;
  /// Steps without inf/NaN before the scale grows. Default 2000, as PyTorch.
  int64_t growthInterval = 2000;
  /// A disabled scaler is a no-op (scale() returns the loss, step() just steps).
  bool enabled = true;
};

/// Thread safety: used by one thread (the training loop). Ownership: keeps a pointer to
/// the communicator (optional: null for a single rank, where no rank must agree on an
/// overflow), which must outlive it.
class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {}, Communicator* communicator = nullptr);

  /// loss * scale. The scale is float32, so a float16 or bfloat16 loss gives a float32
  /// scaled loss (type promotion, as PyTorch): 2^16 would be inf in float16.
  at::Tensor scale(const at::Tensor& loss);
  /// Divides this optimizer's gradients by the scale (once per step) and records
  /// whether any is inf/NaN. Call before clipping.
  void unscale(torch::optim::Optimizer& optimizer);
  /// Unscales if not done yet, agrees on the found-inf flag across ranks, and runs
  /// optimizer.step() unless some gradient was inf/NaN. Returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);
  /// Backs the scale off after a skipped step, grows it after growthInterval good
  /// steps. Call once per iteration, after step().
  /// A rank without samples in a step calls unscale/step/update without scale(): it
  /// takes part in the found-inf agreement with the scale every rank has.
  void update();

  double currentScale() const;
  int64_t growthTracker() const;
  bool isEnabled() const { return options_.enabled; }
  const GradScalerOptions& options() const { return options_; }

  void save(torch::serialize::OutputArchive& archive) const;
  /// What save() wrote. StateError, with the scaler as it was, when an entry is missing
  /// or not one number.
  void load(torch::serialize::InputArchive& archive);

 private:
  void lazyInit(const at::Device& device);
  void initWithoutLoss(torch::optim::Optimizer& optimizer);
  at::Tensor foundInfFor(torch::optim::Optimizer& optimizer);

  GradScalerOptions options_;
  Communicator* communicator_;
  at::Tensor scale_;          // float32, 1 element, on the gradients' device
  at::Tensor growthTracker_;  // int32, 1 element
  struct PerOptimizer {
    bool unscaled = false;
    bool stepped = false;
    at::Tensor foundInf;  // float32, 1 element: > 0 when some gradient was inf/NaN
  };
  std::map<const torch::optim::Optimizer*, PerOptimizer> perOptimizer_;
};

}  // namespace hddp
