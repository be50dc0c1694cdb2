// The trainers' --export, --init-from and --init-skip (example_common.h): the model's
// state dict to and from Python's files (hddp/train/state_dict.h), and what to do when
// a torchvision ResNet's stem does not fit the trainer's.
#include <torch/nn/module.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "example_common.h"
#include "hddp/comm/communicator.h"
#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/train/state_dict.h"

namespace hddp {
namespace examples {
namespace {

// The model's state-dict keys (parameters, then buffers), without copying a tensor.
std::vector<std::string> stateDictKeys(const torch::nn::Module& model) {
  std::vector<std::string> keys;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    keys.push_back(p.key());
  }
  for (const auto& b : model.named_buffers(/*recurse=*/true)) {
    keys.push_back(b.key());
  }
  return keys;
}

// Runs `work` on rank 0 only and shares how it went (one allgather): every rank returns,
// or every rank throws a ConfigError with rank 0's message, so that a failure there is
// not a wait in the next collective on the others.
void onRankZero(Communicator& comm, const std::function<void()>& work) {
  const RankOutcome decided = runAndShareOutcome(comm, comm.rank() == 0, work)[0];
  HDDP_CHECK_AS(ConfigError, !decided.failed(),
                comm.rank() == 0 ? "" : "on rank 0: ", decided.message);
}

// When the file's and the model's conv1.weight are the two ResNet stems (torchvision's
// 7x7 and the CIFAR 3x3 of the trainers' small images), what to do: the trainer's
// --stem, or the two lines of Python that give torchvision's model the CIFAR stem.
// "" for any other mismatch.
std::string stemAdvice(const torch::nn::Module& model, const std::string& path) {
  const auto parameters = model.named_parameters(/*recurse=*/true);
  const auto* modelWeight = parameters.find("conv1.weight");
  if (modelWeight == nullptr || modelWeight->dim() != 4) {
    return "";
  }
  const auto file = readStateDict(path);
  const auto it = file.find("conv1.weight");
  if (it == file.end() || it->second.dim() != 4) {
    return "";
  }
  const auto m = modelWeight->sizes();
  const auto w = it->second.sizes();
  const int64_t channels = m[1];
  if (m[0] != w[0] || m[2] == w[2] || (m[2] != 3 && m[2] != 7) || (w[2] != 3 && w[2] != 7)) {
    return "";
  }
  // A channel count that differs too: what the stem flags alone do not fix.
  const std::string andChannels =
      w[1] == channels
          ? std::string()
          : " (and --channels " + std::to_string(w[1]) + " or a dataset of " +
                std::to_string(w[1]) + " channels: the file's conv1 takes " + std::to_string(w[1]) +
                ", this model's " + std::to_string(channels) + ")";
  if (m[2] == 3) {
    return ". The file has torchvision's ResNet stem (a 7x7 stride-2 conv1 and a max-pool), "
           "this model the CIFAR stem that the trainers use for images of 64 px or less (a 3x3 "
           "stride-1 conv1, no max-pool). Either train with --stem torchvision" +
           andChannels +
           ", or give torchvision's model the CIFAR stem in Python before saving its state "
           "dict: `model.conv1 = torch.nn.Conv2d(" +
           std::to_string(channels) +
           ", 64, 3, 1, 1, bias=False); model.maxpool = torch.nn.Identity()` (docs/train.md, "
           "\"Take your model to Python\")";
  }
  return ". The file has the CIFAR stem (a 3x3 stride-1 conv1, no max-pool), this model "
         "torchvision's (a 7x7 stride-2 conv1 and a max-pool): train with --stem cifar" +
         andChannels;
}

void loadInto(torch::nn::Module& model, const CommonFlags& f) {
  const auto keys = stateDictKeys(model);
  size_t skipped = 0;
  for (const auto& key : keys) {
    for (const auto& prefix : f.initSkip) {
      if (key.compare(0, prefix.size(), prefix) == 0) {
        ++skipped;
        break;
      }
    }
  }
  HDDP_CHECK_AS(ConfigError, f.initSkip.empty() || skipped > 0, "--init-skip ", f.initSkip.front(),
                (f.initSkip.size() > 1 ? " ..." : ""),
                " matches none of the model's keys; they look like '",
                keys.empty() ? std::string() : keys.front(), "'");
  LoadStateDictOptions options;
  options.skipPrefixes = f.initSkip;
  options.allowIntegerFloatConversion = f.initAllowIntFloat;
  LoadStateDictResult result;
  try {
    result = loadStateDict(model, f.initFrom, options);
  } catch (const StateError& e) {
    const std::string advice = stemAdvice(model, f.initFrom);
    if (advice.empty()) {
      throw;
    }
    HDDP_THROW(ConfigError, e.what_without_backtrace(), advice);
  }
  HDDP_LOG_INFO("train", "--init-from ", f.initFrom, ": loaded ", result.loaded.size(), " tensors",
                result.converted.empty()
                    ? ""
                    : ", " + std::to_string(result.converted.size()) + " of them converted",
                skipped ? ", left " + std::to_string(skipped) + " out (--init-skip)" : "");
}

}  // namespace

void initModelFrom(torch::nn::Module& model, const CommonFlags& f, Communicator& comm) {
  if (f.initFrom.empty()) {
    return;
  }
  // Rank 0 reads the file (only its machine needs it); DDP's broadcast at construction
  // gives every rank rank 0's parameters and buffers.
  onRankZero(comm, [&] { loadInto(model, f); });
}

void checkExportPath(const CommonFlags& f, Communicator& comm) {
  if (f.exportPaths.empty()) {
    return;
  }
  onRankZero(comm, [&] {
    for (const auto& path : f.exportPaths) {
      HDDP_CHECK_AS(ConfigError, !path.empty(),
                    "--export: an empty file name (a doubled or trailing comma?)");
      const auto slash = path.find_last_of('/');
      const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
      HDDP_CHECK_AS(ConfigError, ::access(dir.c_str(), W_OK) == 0, "--export ", path,
                    ": cannot write into ", dir, " (", std::strerror(errno),
                    "); create the folder or name another file");
    }
  });
}

void exportModel(const torch::nn::Module& model, const CommonFlags& f, int rank) {
  if (rank != 0) {
    return;
  }
  for (const auto& path : f.exportPaths) {
    saveStateDict(model, path);
    HDDP_LOG_INFO("train", "--export: wrote the model's state dict (", stateDictKeys(model).size(),
                  " tensors) to ", path);
  }
}

}  // namespace examples
}  // namespace hddp
