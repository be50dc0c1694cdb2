// Optimizers of the differential matrix's C++ driver (bench/diff_matrix.cpp): the ones
// reference.py's make_optimizer builds, and their state under torch.optim's names.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "hddp/hddp.h"

namespace diff_matrix {

// reference.py's make_optimizer: one group, or a second one holding fc2's and head's
// parameters with their own learning rate and weight decay. A tied tensor once.
std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const nlohmann::json& o,
                                                       torch::nn::Module& model);

// The optimizer state this rank holds, under the names torch.optim's state_dict uses
// (`state/<name>/<key>`).
void addOptimizerState(torch::optim::Optimizer& opt, const hddp::DistributedDataParallel& ddp,
                       std::vector<std::pair<std::string, at::Tensor>>& out);

}  // namespace diff_matrix
