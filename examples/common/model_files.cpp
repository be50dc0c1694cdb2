// The trainers' --export, --init-from and --init-skip (example_common.h): the model's
// state dict to and from Python's files (hddp/train/state_dict.h).
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
  const auto result = loadStateDict(model, f.initFrom, options);
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
  if (f.exportPath.empty()) {
    return;
  }
  onRankZero(comm, [&] {
    const auto slash = f.exportPath.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : f.exportPath.substr(0, slash + 1);
    HDDP_CHECK_AS(ConfigError, ::access(dir.c_str(), W_OK) == 0, "--export ", f.exportPath,
                  ": cannot write into ", dir, " (", std::strerror(errno),
                  "); create the folder or name another file");
  });
}

void exportModel(const torch::nn::Module& model, const CommonFlags& f, int rank) {
  if (f.exportPath.empty() || rank != 0) {
    return;
  }
  saveStateDict(model, f.exportPath);
  HDDP_LOG_INFO("train", "--export: wrote the model's state dict (", stateDictKeys(model).size(),
                " tensors) to ", f.exportPath);
}

}  // namespace examples
}  // namespace hddp
