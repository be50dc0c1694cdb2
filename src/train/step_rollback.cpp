// A step's changes before it stands, kept for an abandoned step (step_rollback.h).
#include "hddp/train/step_rollback.h"

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>
#include <torch/nn/module.h>

#include <mutex>

namespace hddp {
namespace {

at::Tensor stateOf(at::Generator generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void setState(at::Generator generator, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

}  // namespace

StepRollback::StepRollback(torch::nn::Module& model, c10::Device device)
    : model_(model), device_(device) {}

void StepRollback::capture() {
  // The buffers are looked up each time: a model may replace one (an assignment in its
  // forward), and SyncBatchNorm conversion or a load may have swapped them since.
  buffers_.clear();
  for (const auto& buffer : model_.buffers(/*recurse=*/true)) {
    if (buffer.defined()) {
      buffers_.push_back(buffer);
    }
  }
  bool fits = saved_.size() == buffers_.size();
  for (size_t i = 0; fits && i < buffers_.size(); ++i) {
    fits = saved_[i].sizes() == buffers_[i].sizes() &&
           saved_[i].scalar_type() == buffers_[i].scalar_type() &&
           saved_[i].device() == buffers_[i].device();
  }
  if (!fits) {
    saved_.clear();
    for (const auto& buffer : buffers_) {
      saved_.push_back(at::empty_like(buffer));
    }
  }
  if (!buffers_.empty()) {
    at::NoGradGuard noGrad;
    at::_foreach_copy_(saved_, buffers_);
  }
  hostGenerator_ = stateOf(at::detail::getDefaultCPUGenerator());
  if (device_.type() != c10::kCPU) {
    deviceGenerator_ = stateOf(at::globalContext().defaultGenerator(device_));
  }
  captured_ = true;
}

void StepRollback::restore() {
  if (!captured_) {
    return;
  }
  if (!buffers_.empty()) {
    at::NoGradGuard noGrad;
    at::_foreach_copy_(buffers_, saved_);
  }
  setState(at::detail::getDefaultCPUGenerator(), hostGenerator_);
  if (deviceGenerator_.defined()) {
    setState(at::globalContext().defaultGenerator(device_), deviceGenerator_);
  }
  captured_ = false;
}

}  // namespace hddp
