// The Trainer's helpers for a program's own code (hddp/train/trainer.h): the loss, the
// parameter list an optimizer is built from, and setting the learning rate.
#include <torch/torch.h>

#include <set>

#include "hddp/core/error.h"
#include "hddp/train/trainer.h"

namespace hddp {

Trainer::LossFn crossEntropy(double labelSmoothing) {
  HDDP_CHECK_AS(ConfigError, labelSmoothing >= 0 && labelSmoothing < 1,
                "label smoothing must be in [0, 1), not ", labelSmoothing);
  const auto options =
      torch::nn::functional::CrossEntropyFuncOptions().label_smoothing(labelSmoothing);
  return [options](const at::Tensor& output, const at::Tensor& target) {
    return torch::nn::functional::cross_entropy(output.to(at::kFloat), target, options);
  };
}

std::vector<at::Tensor> uniqueParameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  std::set<const void*> seen;
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) {
      out.push_back(p);
    }
  }
  return out;
}

void setLearningRate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) {
    auto& options = group.options();
    if (auto* o = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
      o->lr(lr);
    } else if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
      o->lr(lr);
    } else if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
      o->lr(lr);
    } else if (auto* o = dynamic_cast<torch::optim::RMSpropOptions*>(&options)) {
      o->lr(lr);
    } else if (auto* o = dynamic_cast<torch::optim::AdagradOptions*>(&options)) {
      o->lr(lr);
    } else {
      options.set_lr(lr);
    }
  }
}

}  // namespace hddp
