// ShardedOptimizer (hddp/ddp/sharded_optimizer.h): each rank's part of the optimizer
// state in a state file (saveShard), and its re-sharding into any layout (loadShards).
//
// A part is an archive of
//   format            2 (1: written before the parameter groups were; still read)
//   optimizer         the OptimizerKind
//   parameters, numels, names, p<i>
//                     the state of each parameter of the shard that has one (by name,
//                     with its size), as the optimizer's ParamState serializes it
//   param_groups/size, param_groups/<g>/options
//                     every group's options (lr, momentum, betas, eps, weight decay,
//                     nesterov, amsgrad), as LibTorch's optimizer.save() writes them;
//                     the same in every part
//   members/names, members/groups
//                     the group of each parameter of the shard (-1: in none), so that
//                     the parts of all ranks give the membership of every group
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <sstream>
#include <string>

#include "ddp/sharded_optimizer_impl.h"
#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

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

std::unique_ptr<torch::optim::OptimizerOptions> newOptions(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::Sgd:
      return std::make_unique<torch::optim::SGDOptions>(0.0);
    case OptimizerKind::Adam:
      return std::make_unique<torch::optim::AdamOptions>();
    case OptimizerKind::AdamW:
      return std::make_unique<torch::optim::AdamWOptions>();
  }
  return nullptr;
}

at::Tensor namesTensor(const std::string& joined) {
  return at::from_blob(const_cast<char*>(joined.data()), {static_cast<int64_t>(joined.size())},
                       at::kByte)
      .clone();
}

std::vector<std::string> namesOf(const at::Tensor& bytes) {
  const auto* data = bytes.data_ptr<uint8_t>();
  std::stringstream in(std::string(data, data + bytes.numel()));
  std::vector<std::string> names;
  std::string line;
  while (std::getline(in, line)) {
    names.push_back(line);
  }
  return names;
}

std::string groupText(int64_t group) {
  return group < 0 ? std::string("no parameter group (not stepped by the optimizer)")
                   : "parameter group " + std::to_string(group);
}

constexpr int64_t kFormat = 2;

}  // namespace

std::vector<uint8_t> ShardedOptimizer::Impl::saveShard() const {
  torch::serialize::OutputArchive archive;
  archive.write("format", at::tensor(kFormat));
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
  archive.write("names", namesTensor(names));
  // The groups' options, which optimizer.save() keeps for a whole optimizer (a schedule's
  // learning rate among them), and which group each parameter of the shard is in.
  const auto& groups = optimizer_.param_groups();
  archive.write("param_groups/size", at::tensor(static_cast<int64_t>(groups.size())));
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::OutputArchive group;
    torch::serialize::OutputArchive options;
    groups[g].options().serialize(options);
    group.write("options", options);
    archive.write("param_groups/" + std::to_string(g), group);
  }
  std::string members;
  std::vector<int64_t> memberGroups;
  for (int i = layout_.begin[rank]; i < layout_.end[rank]; ++i) {
    members += names_[static_cast<size_t>(i)] + "\n";
    memberGroups.push_back(groupOf_[static_cast<size_t>(i)]);
  }
  archive.write("members/names", namesTensor(members));
  archive.write("members/groups", at::tensor(memberGroups, at::kLong));
  std::ostringstream out;
  archive.save_to(out);
  const std::string s = out.str();
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> ShardedOptimizer::Impl::savedGroups(
    std::vector<torch::serialize::InputArchive>& archives) const {
  const auto& groups = optimizer_.param_groups();
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options;
  std::vector<bool> named(params_.size(), false);
  size_t withGroups = 0;
  for (size_t part = 0; part < archives.size(); ++part) {
    auto& archive = archives[part];
    at::Tensor count;
    if (!archive.try_read("param_groups/size", count)) {
      continue;
    }
    ++withGroups;
    HDDP_CHECK_AS(StateError, count.item<int64_t>() == static_cast<int64_t>(groups.size()),
                  "optimizer state part ", part, " was saved by an optimizer with ",
                  count.item<int64_t>(), " parameter group(s); this one has ", groups.size(),
                  ". Build the optimizer with the parameter groups it was saved with");
    at::Tensor memberNames;
    at::Tensor memberGroups;
    archive.read("members/names", memberNames);
    archive.read("members/groups", memberGroups);
    const auto members = namesOf(memberNames);
    memberGroups = memberGroups.to(at::kLong).contiguous();
    HDDP_CHECK_AS(StateError, static_cast<int64_t>(members.size()) == memberGroups.numel(),
                  "optimizer state part ", part, " names ", members.size(),
                  " parameters for the groups of ", memberGroups.numel());
    const auto* saved = memberGroups.data_ptr<int64_t>();
    for (size_t k = 0; k < members.size(); ++k) {
      const auto found = byName_.find(members[k]);
      const int64_t here =
          found == byName_.end() ? -1 : groupOf_[static_cast<size_t>(found->second)];
      HDDP_CHECK_AS(StateError, saved[k] == here, "optimizer state part ", part, ": parameter '",
                    members[k], "' was in ", groupText(saved[k]), " when saved and is in ",
                    groupText(here),
                    " of this optimizer. Build the optimizer with the parameter groups it was "
                    "saved with");
      if (found != byName_.end()) {
        named[static_cast<size_t>(found->second)] = true;
      }
    }
    if (!options.empty()) {
      continue;  // every part holds the same options: the first one's are taken
    }
    for (size_t g = 0; g < groups.size(); ++g) {
      torch::serialize::InputArchive group;
      torch::serialize::InputArchive savedOptions;
      archive.read("param_groups/" + std::to_string(g), group);
      group.read("options", savedOptions);
      auto read = newOptions(kind_);
      read->serialize(savedOptions);
      options.push_back(std::move(read));
    }
  }
  if (withGroups == 0) {
    HDDP_LOG_WARN("ddp",
                  "the optimizer state was saved without its parameter groups' options "
                  "(by an older hddp): the learning rate, momentum, betas and weight decay are "
                  "this program's, not the saved run's");
    return options;
  }
  if (withGroups == archives.size()) {
    // The parts of every rank name every parameter of the saved model once: one in a group
    // here that none names was not in the saved optimizer.
    for (size_t i = 0; i < params_.size(); ++i) {
      HDDP_CHECK_AS(StateError, groupOf_[i] < 0 || named[i], "parameter '", names_[i], "' is in ",
                    groupText(groupOf_[i]),
                    " of this optimizer, but the saved optimizer's groups do not hold it. Build "
                    "the optimizer with the parameter groups it was saved with");
    }
  }
  return options;
}

void ShardedOptimizer::Impl::loadShards(const std::vector<std::vector<uint8_t>>& parts) {
  const int rank = comm_.rank();
  // Every part is read and checked before anything changes: a file that does not fit
  // leaves the optimizer as it was.
  std::vector<torch::serialize::InputArchive> archives(parts.size());
  for (size_t part = 0; part < parts.size(); ++part) {
    auto& archive = archives[part];
    const auto& bytes = parts[part];
    archive.load_from(reinterpret_cast<const char*>(bytes.data()), bytes.size(),
                      c10::Device(c10::kCPU));
    at::Tensor format;
    HDDP_CHECK_AS(StateError,
                  !archive.try_read("format", format) || format.item<int64_t>() <= kFormat,
                  "optimizer state part ", part, " has format ", format.item<int64_t>(),
                  ", newer than this hddp reads (", kFormat, "); load it with a newer hddp");
    at::Tensor kind;
    archive.read("optimizer", kind);
    HDDP_CHECK_AS(StateError, kind.item<int64_t>() == static_cast<int64_t>(kind_),
                  "optimizer state part ", part, " was saved by a ",
                  kindName(static_cast<OptimizerKind>(kind.item<int64_t>())),
                  " optimizer; this one is ", kindName(kind_));
  }
  auto options = savedGroups(archives);
  // The shard's states are read into `staged` and installed only when every part has
  // been read: a part that does not fit throws before the optimizer changes.
  // Staged on the host: moved to the device after the old states are gone, so that a
  // load into an optimizer with state does not hold the shard twice on the device.
  std::vector<std::pair<int64_t, std::unique_ptr<torch::optim::OptimizerParamState>>> staged;
  for (size_t part = 0; part < archives.size(); ++part) {
    auto& archive = archives[part];
    at::Tensor indices;
    at::Tensor numels;
    archive.read("parameters", indices);
    archive.read("numels", numels);
    // By name: a parameter frozen or unfrozen since the save shifts the indices.
    at::Tensor nameBytes;
    archive.read("names", nameBytes);
    const auto savedNames = namesOf(nameBytes);
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
      staged.emplace_back(i, std::move(state));
    }
  }
  // Parameters of this shard lose the state they had: the parts are the truth.
  for (int i = layout_.begin[rank]; i < layout_.end[rank]; ++i) {
    optimizer_.state().erase(params_[i].unsafeGetTensorImpl());
  }
  for (auto& item : staged) {
    moveState(*item.second, params_[item.first]);
    optimizer_.state()[params_[item.first].unsafeGetTensorImpl()] = std::move(item.second);
  }
  // The saved options replace the program's, as optimizer.load() does for a whole
  // optimizer: on every rank, a rank without a shard included (its groups are empty).
  for (size_t g = 0; g < options.size(); ++g) {
    optimizer_.param_groups()[g].set_options(std::move(options[g]));
  }
}

}  // namespace hddp
