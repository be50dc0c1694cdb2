// DDP's "gradient ready" hook (private to the ddp layer).
#pragma once

#include <torch/csrc/autograd/function_hook.h>

#include <functional>
#include <memory>

namespace hddp {
namespace ddp {

// Runs after AccumulateGrad has added a gradient into the parameter's .grad. Kept in
// the parameter's own autograd metadata (not on its gradient accumulator node), so it
// survives Module::load(), Tensor::set_() and anything else that gives the parameter
// a new accumulator. A hook the user had installed before runs first.
class ReadyHook : public torch::autograd::PostAccumulateGradHook {
 public:
  ReadyHook(std::function<void()> onReady,
            std::unique_ptr<torch::autograd::PostAccumulateGradHook> previous)
      : onReady_(std::move(onReady)), previous_(std::move(previous)) {}
  void operator()(const torch::autograd::Variable& tensor) override {
    if (previous_) {
      (*previous_)(tensor);
    }
    onReady_();
  }
  std::unique_ptr<torch::autograd::PostAccumulateGradHook> takePrevious() {
    return std::move(previous_);
  }

 private:
  std::function<void()> onReady_;
  std::unique_ptr<torch::autograd::PostAccumulateGradHook> previous_;
};

}  // namespace ddp
}  // namespace hddp
