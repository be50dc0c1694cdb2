// Marks gradients that are computed only to be handed back into an outer backward
// (activation checkpointing's recomputation). Since torch 2.x, tensor hooks on a leaf
// also run on gradients captured by torch::autograd::grad; hooks that transform a
// gradient (DDP's b_i/B weighting) must then skip the capture, or the outer backward
// would apply them a second time. Thread-local: a reentrant backward runs on the
// thread that started it.
#pragma once

namespace hddp {
namespace detail {

class GradientCaptureScope {
 public:
  GradientCaptureScope();
  ~GradientCaptureScope();
  GradientCaptureScope(const GradientCaptureScope&) = delete;
  GradientCaptureScope& operator=(const GradientCaptureScope&) = delete;
};

/// True while a GradientCaptureScope is active on this thread.
bool capturingInnerGradients() noexcept;

}  // namespace detail
}  // namespace hddp
