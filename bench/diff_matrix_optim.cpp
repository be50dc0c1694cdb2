// Optimizers of the differential matrix's C++ driver (diff_matrix_optim.h).
#include "diff_matrix_optim.h"

#include <set>
#include <tuple>

namespace diff_matrix {

using json = nlohmann::json;

namespace {

std::unique_ptr<torch::optim::OptimizerOptions> optionsOf(const json& o, double lr, double decay) {
  const std::string kind = o.at("kind");
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(lr)
                                                          .momentum(o.at("momentum"))
                                                          .dampening(o.at("dampening"))
                                                          .nesterov(o.at("nesterov"))
                                                          .weight_decay(decay));
  }
  const std::tuple<double, double> betas{o.at("betas").at(0), o.at("betas").at(1)};
  if (kind == "adam") {
    return std::make_unique<torch::optim::AdamOptions>(torch::optim::AdamOptions(lr)
                                                           .betas(betas)
                                                           .eps(o.at("eps"))
                                                           .weight_decay(decay)
                                                           .amsgrad(o.at("amsgrad")));
  }
  HDDP_CHECK(kind == "adamw", "unknown optimizer '", kind, "'");
  return std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(lr)
                                                          .betas(betas)
                                                          .eps(o.at("eps"))
                                                          .weight_decay(decay)
                                                          .amsgrad(o.at("amsgrad")));
}

}  // namespace

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const json& o, torch::nn::Module& model) {
  std::vector<at::Tensor> first, second;
  std::set<const void*> seen;
  const bool grouped = o.contains("second_group") && !o.at("second_group").is_null();
  for (const auto& item : model.named_parameters()) {
    if (!item.value().requires_grad() || !seen.insert(item.value().unsafeGetTensorImpl()).second) {
      continue;  // frozen (ZeRO takes only what DDP synchronizes), or tied and seen
    }
    const std::string top = item.key().substr(0, item.key().find('.'));
    (grouped && (top == "fc2" || top == "head") ? second : first).push_back(item.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(first);
  if (!second.empty()) {
    const json& g = o.at("second_group");
    groups.emplace_back(second,
                        optionsOf(o, o.at("lr").get<double>() * g.at("lr_scale").get<double>(),
                                  g.at("weight_decay")));
  }
  auto defaults = optionsOf(o, o.at("lr"), o.at("weight_decay"));
  const std::string kind = o.at("kind");
  if (kind == "sgd") {
    return std::make_unique<torch::optim::SGD>(groups,
                                               static_cast<torch::optim::SGDOptions&>(*defaults));
  }
  if (kind == "adam") {
    return std::make_unique<torch::optim::Adam>(groups,
                                                static_cast<torch::optim::AdamOptions&>(*defaults));
  }
  return std::make_unique<torch::optim::AdamW>(groups,
                                               static_cast<torch::optim::AdamWOptions&>(*defaults));
}

void addOptimizerState(torch::optim::Optimizer& opt, const hddp::DistributedDataParallel& ddp,
                       std::vector<std::pair<std::string, at::Tensor>>& out) {
  const auto params = ddp.parameters();
  const auto names = ddp.parameterNames();
  auto& state = opt.state();
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = state.find(params[i].unsafeGetTensorImpl());
    if (it == state.end()) {
      continue;
    }
    const std::string prefix = "state/" + names[i] + "/";
    auto put = [&](const char* key, const at::Tensor& t) {
      if (t.defined()) {
        out.emplace_back(prefix + key, t.detach().clone());
      }
    };
    if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
      put("momentum_buffer", sgd->momentum_buffer());
    } else if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
      put("step", torch::tensor(static_cast<double>(adam->step()), torch::kDouble));
      put("exp_avg", adam->exp_avg());
      put("exp_avg_sq", adam->exp_avg_sq());
      put("max_exp_avg_sq", adam->max_exp_avg_sq());
    } else if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
      put("step", torch::tensor(static_cast<double>(adamw->step()), torch::kDouble));
      put("exp_avg", adamw->exp_avg());
      put("exp_avg_sq", adamw->exp_avg_sq());
      put("max_exp_avg_sq", adamw->max_exp_avg_sq());
    } else {
      HDDP_CHECK(false, "optimizer state of an unknown kind for '", names[i], "'");
    }
  }
}

}  // namespace diff_matrix
