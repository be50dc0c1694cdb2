// convertSyncBatchNorm (hddp/ddp/sync_batch_norm.h): torch::nn::BatchNorm*d layers
// replaced by SyncBatchNorm wherever the model holds them in a way a library can
// reach (module registries and Sequential entries), or none at all.
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <map>
#include <unordered_set>

#include "ddp/batch_norm_layers.h"
#include "hddp/core/error.h"
#include "hddp/ddp/sync_batch_norm.h"

namespace hddp {

const torch::nn::BatchNormOptions* ddp::plainBatchNormOptions(const torch::nn::Module& module) {
  if (const auto* bn = dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&module)) {
    return &bn->options;
  }
  if (const auto* bn = dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&module)) {
    return &bn->options;
  }
  if (const auto* bn = dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&module)) {
    return &bn->options;
  }
  return nullptr;
}

std::vector<std::string> ddp::localBatchNormLayers(const torch::nn::Module& module) {
  std::vector<std::string> names;
  std::unordered_set<const torch::nn::Module*> seen;
  const auto* own = plainBatchNormOptions(module);
  if (own && (module.is_training() || !own->track_running_stats())) {
    names.push_back("(the model itself)");
  }
  // Without the root: a module object not owned by a shared_ptr cannot be listed.
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    const auto* options = plainBatchNormOptions(*item.value());
    if (options && seen.insert(item.value().get()).second &&
        (item.value()->is_training() || !options->track_running_stats())) {
      names.push_back(item.key());
    }
  }
  return names;
}

namespace {

// A plain BatchNorm under the root and each place in the module tree that holds it.
struct Holders {
  std::shared_ptr<torch::nn::Module> layer;  // the walk's one reference, while converting
  std::vector<std::string> names;            // its registered names, from the root
  std::vector<std::pair<torch::nn::Module*, std::string>> registrations;  // parent, key
  std::vector<std::pair<torch::nn::SequentialImpl*, size_t>> entries;     // Sequential, index
};

struct Walk {
  std::unordered_set<const torch::nn::Module*> visited;
  std::map<const torch::nn::Module*, Holders> found;
  std::vector<const torch::nn::Module*> order;  // of first sight, for the messages
  std::vector<SyncBatchNormImpl*> syncs;

  Holders& at(const std::shared_ptr<torch::nn::Module>& layer) {
    auto [it, isNew] = found.try_emplace(layer.get());
    if (isNew) {
      it->second.layer = layer;
      order.push_back(layer.get());
    }
    return it->second;
  }

  // Every temporary copy of a child's shared_ptr (named_children()'s dictionary, a
  // Sequential entry's ptr()) is gone when the walk returns, so that afterwards each
  // layer's use_count is its holders in the tree plus `layer`.
  void visit(torch::nn::Module& module, const std::string& prefix) {
    if (!visited.insert(&module).second) {
      return;  // a submodule registered twice: its children are counted once
    }
    if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&module)) {
      size_t index = 0;
      for (auto& entry : *seq) {
        std::shared_ptr<torch::nn::Module> held = entry.ptr();
        if (ddp::plainBatchNormOptions(*held)) {
          at(held).entries.emplace_back(seq, index);
        }
        ++index;
      }
    }
    for (const auto& item : module.named_children()) {
      const std::string full = prefix.empty() ? item.key() : prefix + "." + item.key();
      const std::shared_ptr<torch::nn::Module>& child = item.value();
      if (auto* sync = child->as<SyncBatchNormImpl>()) {
        syncs.push_back(sync);
      } else if (ddp::plainBatchNormOptions(*child)) {
        Holders& h = at(child);
        h.names.push_back(full);
        h.registrations.emplace_back(&module, item.key());
      } else {
        visit(*child, full);
      }
    }
  }
};

std::string quoted(const std::vector<std::string>& names, size_t most = 6) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < most; ++i) {
    out += (i ? ", '" : "'") + names[i] + "'";
  }
  if (names.size() > most) {
    out += " and " + std::to_string(names.size() - most) + " more";
  }
  return out;
}

// A SyncBatchNorm that takes `bn`'s place: its options, and its own tensors' values,
// devices, dtypes and requires_grad (num_batches_tracked stays an integer).
SyncBatchNorm replacementFor(const torch::nn::Module& bn) {
  SyncBatchNorm sync(*ddp::plainBatchNormOptions(bn));
  torch::NoGradGuard noGrad;
  const auto params = bn.named_parameters(/*recurse=*/false);
  for (auto& p : sync->named_parameters(/*recurse=*/false)) {
    p.value().set_data(params[p.key()].detach().clone());
    p.value().requires_grad_(params[p.key()].requires_grad());
  }
  const auto buffers = bn.named_buffers(/*recurse=*/false);
  for (auto& b : sync->named_buffers(/*recurse=*/false)) {
    b.value().set_data(buffers[b.key()].detach().clone());
  }
  sync->train(bn.is_training());
  return sync;
}

}  // namespace

std::vector<std::string> convertSyncBatchNorm(torch::nn::Module& module,
                                              Communicator& communicator) {
  HDDP_CHECK_AS(ConfigError, !ddp::plainBatchNormOptions(module),
                "convertSyncBatchNorm: the module is itself a torch::nn::BatchNorm; it can "
                "only replace layers inside a model (build an hddp::SyncBatchNorm instead)");
  Walk walk;
  walk.visit(module, "");
  std::vector<std::string> heldElsewhere;
  std::vector<std::string> cumulative;
  for (const auto* layer : walk.order) {
    const Holders& h = walk.found.at(layer);
    const std::string name = h.names.empty() ? "(a Sequential entry)" : h.names.front();
    const long known = static_cast<long>(h.registrations.size() + h.entries.size()) + 1;
    if (h.layer.use_count() > known) {
      heldElsewhere.push_back(name);
    }
    if (!ddp::plainBatchNormOptions(*h.layer)->momentum().has_value()) {
      cumulative.push_back(name);
    }
  }
  HDDP_CHECK_AS(ConfigError, heldElsewhere.empty(), "cannot convert BatchNorm layer(s) ",
                quoted(heldElsewhere),
                " to SyncBatchNorm: besides the module registry, something holds them that no "
                "library can rebind, usually a member field (`torch::nn::BatchNorm2d bn;` "
                "with `bn = register_module(\"bn\", ...)`); its type admits only torch's "
                "BatchNorm, so the forward would keep normalising each rank's share alone. "
                "Declare those fields as hddp::SyncBatchNorm (`hddp::SyncBatchNorm bn{nullptr};`"
                ": the same constructor argument and state-dict names, plain BatchNorm without "
                "a communicator), or hold the layers in a torch::nn::Sequential; then call "
                "convertSyncBatchNorm again. (A ModuleList entry, a std::vector or an "
                "AnyModule field counts as such a holder too.) Nothing was converted.");
  HDDP_CHECK_AS(ConfigError, cumulative.empty(), "cannot convert BatchNorm layer(s) ",
                quoted(cumulative),
                " to SyncBatchNorm: their momentum is nullopt (a cumulative moving average), "
                "which SyncBatchNorm does not keep; give them a momentum (torch's default is "
                "0.1). Nothing was converted.");
  std::vector<std::string> converted;
  for (const auto* layer : walk.order) {
    Holders& h = walk.found.at(layer);
    SyncBatchNorm sync = replacementFor(*h.layer);
    sync->setCommunicator(&communicator);
    for (auto& [parent, key] : h.registrations) {
      parent->replace_module(key, sync.ptr());
    }
    for (auto& [seq, index] : h.entries) {
      *(seq->begin() + static_cast<std::ptrdiff_t>(index)) = torch::nn::AnyModule(sync);
    }
    converted.insert(converted.end(), h.names.begin(), h.names.end());
  }
  for (auto* sync : walk.syncs) {
    sync->setCommunicator(&communicator);
  }
  return converted;
}

}  // namespace hddp
