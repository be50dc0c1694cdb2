// ShardedOptimizer (hddp/ddp/sharded_optimizer.h): each rank's part of the optimizer
// state in a state file (saveShard), and its re-sharding into any layout (loadShards).
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <sstream>

#include "ddp/sharded_optimizer_impl.h"
#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"

namespace hddp {

using zero::kindName;
using zero::OptimizerKind;

namespace {

std::unique_ptr<torch::optim::OptimizerParamState> newState(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::Sgd:
      return std::make_unique<torch::optim::SGDParamState>();
    case OptimizerKind::Adam:
      return std::make_unique<torch::optim::AdamParamState>();
    case OptimizerKind::AdamW:
      return std::make_unique<torch::optim::AdamWParamState>();
  }
  return nullptr;
}

// Moves a loaded state's tensors to the parameter's device.
void moveState(torch::optim::OptimizerParamState& state, const at::Tensor& param) {
  auto to = [&](const at::Tensor& t) { return t.defined() ? t.to(param.device()) : t; };
  if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(&state)) {
    s->momentum_buffer(to(s->momentum_buffer()));
  } else if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(&state)) {
    s->exp_avg(to(s->exp_avg()));
    s->exp_avg_sq(to(s->exp_avg_sq()));
    s->max_exp_avg_sq(to(s->max_exp_avg_sq()));
  } else if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(&state)) {
    s->exp_avg(to(s->exp_avg()));
    s->exp_avg_sq(to(s->exp_avg_sq()));
    s->max_exp_avg_sq(to(s->max_exp_avg_sq()));
  }
}

}  // namespace

std::vector<uint8_t> ShardedOptimizer::Impl::saveShard() const {
  torch::serialize::OutputArchive archive;
  archive.write("format", at::tensor(int64_t{1}));
  archive.write("optimizer", at::tensor(static_cast<int64_t>(kind_)));
  const int rank = comm_.rank();
  std::vector<int64_t> indices;
  std::vector<int64_t> numels;
  for (int i = layout_.begin[rank]; i < layout_.end[rank]; ++i) {
    const auto found = optimizer_.state().find(params_[i].unsafeGetTensorImpl());
    if (found == optimizer_.state().end()) {
      continue;
    }
    torch::serialize::OutputArchive one;
    found->second->serialize(one);
    archive.write("p" + std::to_string(i), one);
    indices.push_back(i);
    numels.push_back(params_[i].numel());
  }
  archive.write("parameters", at::tensor(indices, at::kLong));
  archive.write("numels", at::tensor(numels, at::kLong));
  std::string names;
  for (int64_t i : indices) {
    names += names_[static_cast<size_t>(i)] + "\n";
  }
  archive.write(
      "names",
      at::from_blob(names.data(), {static_cast<int64_t>(names.size())}, at::kByte).clone());
  std::ostringstream out;
  archive.save_to(out);
  const std::string s = out.str();
  return std::vector<uint8_t>(s.begin(), s.end());
}

void ShardedOptimizer::Impl::loadShards(const std::vector<std::vector<uint8_t>>& parts) {
  const int rank = comm_.rank();
  // Parameters of this shard lose the state they had: the parts are the truth.
  for (int i = layout_.begin[rank]; i < layout_.end[rank]; ++i) {
    optimizer_.state().erase(params_[i].unsafeGetTensorImpl());
  }
  for (size_t part = 0; part < parts.size(); ++part) {
    torch::serialize::InputArchive archive;
    const auto& bytes = parts[part];
    archive.load_from(reinterpret_cast<const char*>(bytes.data()), bytes.size(),
                      c10::Device(c10::kCPU));
    at::Tensor kind;
    archive.read("optimizer", kind);
    HDDP_CHECK_AS(StateError, kind.item<int64_t>() == static_cast<int64_t>(kind_),
                  "optimizer state part ", part, " was saved by a ",
                  kindName(static_cast<OptimizerKind>(kind.item<int64_t>())),
                  " optimizer; this one is ", kindName(kind_));
    at::Tensor indices;
    at::Tensor numels;
    archive.read("parameters", indices);
    archive.read("numels", numels);
    // By name: a parameter frozen or unfrozen since the save shifts the indices.
    at::Tensor nameBytes;
    archive.read("names", nameBytes);
    std::vector<std::string> savedNames;
    {
      const auto* data = nameBytes.data_ptr<uint8_t>();
      std::stringstream in(std::string(data, data + nameBytes.numel()));
      std::string line;
      while (std::getline(in, line)) {
        savedNames.push_back(line);
      }
    }
    HDDP_CHECK_AS(StateError, static_cast<int64_t>(savedNames.size()) == indices.numel(),
                  "optimizer state part ", part, " names ", savedNames.size(), " parameters for ",
                  indices.numel(), " states");
    for (int64_t k = 0; k < indices.numel(); ++k) {
      const std::string& name = savedNames[static_cast<size_t>(k)];
      const auto found = byName_.find(name);
      HDDP_CHECK_AS(StateError, found != byName_.end(), "optimizer state part ", part,
                    " holds the state of '", name,
                    "', which this model does not train (renamed, or frozen now)");
      const int64_t i = found->second;
      HDDP_CHECK_AS(StateError, i >= 0 && i < static_cast<int64_t>(params_.size()),
                    "optimizer state part ", part, " holds parameter ", i, "; this model has ",
                    params_.size(), " trainable parameters");
      HDDP_CHECK_AS(StateError, numels[k].item<int64_t>() == params_[i].numel(),
                    "optimizer state part ", part, ": parameter ", i, " ('", names_[i], "') has ",
                    numels[k].item<int64_t>(), " elements there and ", params_[i].numel(),
                    " in this model");
      if (layout_.owner[static_cast<size_t>(i)] != rank) {
        continue;
      }
      torch::serialize::InputArchive one;
      archive.read("p" + std::to_string(indices[k].item<int64_t>()), one);
      auto state = newState(kind_);
      state->serialize(one);
      moveState(*state, params_[i]);
      optimizer_.state()[params_[i].unsafeGetTensorImpl()] = std::move(state);
    }
  }
}

}  // namespace hddp
