// The steps of a Trainer state file's load (state_load_steps.h): what each reads and
// checks before anything changes, what each then applies, and the agreement of each step.
#include "train/state_load_steps.h"

#include <ATen/core/Generator.h>
#include <torch/torch.h>

#include <functional>
#include <mutex>
#include <new>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "hddp/amp/grad_scaler.h"
#include "hddp/balance/compression_model.h"
#include "hddp/balance/planner.h"
#include "hddp/comm/communicator.h"
#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/power_sgd.h"
#include "hddp/ddp/sharded_optimizer.h"
#include "train/archive_check.h"
#include "train/state_archive.h"

namespace hddp {
namespace train {
namespace {

// PowerSGD's state from a saved rank's part. The step and the Q memories are the same
// on every rank; the error memories are the rank's own, in units of its 1/n part of the
// sum: where the group changed they no longer fit and start from zero (logged).
void readPowerSgd(OwnPart& own, InputArchive& saved) {
  InputArchive archive;
  own.hasPowerSgd = saved.try_read("powersgd", archive);
  if (!own.hasPowerSgd) {
    return;
  }
  for (const auto& key : archive.keys()) {
    if (!own.sameGroup && (key.rfind("error/", 0) == 0 || key.rfind("error.", 0) == 0)) {
      own.droppedErrors = true;
      continue;
    }
    at::Tensor t;
    archive.read(key, t);
    own.powerSgd.emplace_back(key, t);
  }
}

// The loaded optimizer state (on the host) goes to each parameter's device, as PyTorch's
// Optimizer.load_state_dict casts it: a momentum buffer of rank 0's cuda:0 must not stay
// on the host or on cuda:0 for a rank training on cuda:1. Any optimizer's per-parameter
// state moves through its own serialization (an archive loaded onto the device), so
// LBFGS and users' optimizers move as SGD and Adam do.
void moveOptimizerStateToParameters(torch::optim::Optimizer& optimizer) {
  auto& state = optimizer.state();
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      const auto it = state.find(p.unsafeGetTensorImpl());
      if (it == state.end() || !it->second || p.device().is_cpu()) {
        continue;  // loaded onto the host already
      }
      OutputArchive out;
      it->second->serialize(out);
      std::ostringstream bytes;
      out.save_to(bytes);
      std::istringstream in(bytes.str());
      InputArchive onDevice;
      onDevice.load_from(in, p.device());
      it->second->serialize(onDevice);
    }
  }
}

// LibTorch's refusals of the model's or the optimizer's entries as a StateError; memory
// and device failures pass as they are (the file is not at fault).
template <typename Work>
void asModelOrOptimizerError(const std::string& path, Work&& work) {
  try {
    work();
  } catch (const StateError&) {
    throw;
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::AcceleratorError&) {
    throw;
  } catch (const c10::Error& e) {
    rethrowIfOutOfMemory();  // LibTorch's CPU allocator's: host memory, not the file
    HDDP_THROW(StateError, "state file ", path,
               " does not fit this model or optimizer: ", e.what_without_backtrace());
  }
}

}  // namespace

InputArchive savedBlob(InputArchive& file, int64_t index, const std::string& path) {
  const std::string key = "rank" + std::to_string(index);
  const std::string bytes = tensorBytes(readTensor(file, key, path));
  InputArchive blob;
  loadArchive(blob, bytes, "state file " + path + ": its '" + key + "'", std::nullopt);
  return blob;
}

OwnPart readOwnPart(const StateParts& parts, InputArchive& file, const std::vector<int>& from,
                    int64_t savedRanks, bool hasPlanner, const std::string& path) {
  OwnPart own;
  const int source = from[static_cast<size_t>(parts.comm.rank())];
  own.sameGroup = savedRanks == static_cast<int64_t>(from.size());
  for (size_t r = 0; r < from.size(); ++r) {
    own.sameGroup = own.sameGroup && from[r] == static_cast<int>(r);
  }
  own.hasOwn = source >= 0;
  InputArchive mine = savedBlob(file, own.hasOwn ? source : 0, path);
  if (own.hasOwn) {
    own.cpuRng = readTensor(mine, "cpu_rng", path);
    // Checked on a generator of its own: what LibTorch refuses fails before any change.
    setGeneratorState(at::detail::createCPUGenerator(), own.cpuRng);
    if (parts.device.type() != c10::kCPU && mine.try_read("device_rng", own.deviceRng)) {
      at::Generator device = at::globalContext().defaultGenerator(parts.device);  // shared
      at::Generator copy;
      {
        std::lock_guard<std::mutex> lock(device.mutex());
        copy = device.clone();
      }
      setGeneratorState(copy, own.deviceRng);  // on a copy of the device's generator
    }
    if (parts.planner && hasPlanner) {
      readArchive(mine, "planner", own.planner, path);
    }
  }
  if (parts.powerSgd || parts.adoptCompression) {
    readPowerSgd(own, mine);
    if (own.hasPowerSgd) try {  // checked on a state of its own: nothing changes yet
        PowerSgdState().loadStateDict(own.powerSgd);
      } catch (const StateError&) {
        throw;
      } catch (const Error& e) {
        HDDP_THROW(StateError, "state file ", path,
                   ": its PowerSGD state: ", e.what_without_backtrace());
      }
  }
  at::Tensor compression;  // one --compress auto would adopt must parse
  if (parts.adoptCompression && file.try_read("compression", compression)) {
    const std::string saved = tensorBytes(compression);
    if (saved != parts.compression && saved != "hook") {
      CompressionSpec::parse(saved, path + ": compression");
    }
  }
  return own;
}

// The planner from the file: it checks everything it reads before it changes anything.
void loadPlanner(const StateParts& parts, OwnPart& own, InputArchive& shared,
                 const std::vector<int>& from) {
  if (own.sameGroup) {
    parts.planner->load(shared, own.planner);
  } else {
    parts.planner->loadRemapped(shared, own.hasOwn ? &own.planner : nullptr, from);
  }
}

void applyOwnPart(const StateParts& parts, OwnPart& own, const std::vector<int>& from,
                  int64_t savedRanks) {
  if (own.hasOwn) {
    setGeneratorState(at::detail::getDefaultCPUGenerator(), own.cpuRng);
    if (own.deviceRng.defined()) {
      setGeneratorState(at::globalContext().defaultGenerator(parts.device), own.deviceRng);
    }
  }
  if (!parts.powerSgd) {
    return;
  }
  if (!own.hasPowerSgd) {  // a file saved without PowerSGD: the hook starts fresh
    HDDP_LOG_INFO("train", "the state file holds no PowerSGD state: it starts afresh");
    return;
  }
  parts.powerSgd->loadStateDict(own.powerSgd);
  if (own.droppedErrors) {
    HDDP_LOG_INFO("train", "PowerSGD: saved by ", savedRanks, " ranks, resumed by ", from.size(),
                  " in another group: error memories start from zero (Q memories and the "
                  "step count go on)");
  }
}

StateMeta::Progress readProgress(InputArchive& archive, const std::string& path) {
  StateMeta::Progress g;
  at::Tensor progress;
  if (!archive.try_read("progress", progress) || progress.numel() != 7) {
    return g;
  }
  const at::Tensor p = progress.to(at::kDouble).contiguous();
  const double* v = p.data_ptr<double>();
  // A count beyond int64 would be converted out of range (undefined behaviour).
  const auto count = [&path](double x) {
    HDDP_CHECK_AS(StateError, x >= -9.0e18 && x <= 9.0e18, "state file ", path,
                  ": its progress record holds a count of ", x,
                  "; resume from an earlier state file");
    return static_cast<int64_t>(x);
  };
  g.epochLossSum = v[0];
  g.epochSamples = count(v[1]);
  g.epochSteps = count(v[2]);
  g.budgetSeconds = v[3];
  g.budgetEvaluationSeconds = v[4];
  g.budgetStartStep = count(v[5]);
  g.budgetSteps = count(v[6]);
  g.present = true;
  return g;
}

void agreeLoadStep(Communicator& comm, const std::string& path, const std::function<void()>& work) {
  std::exception_ptr error;
  // State: the file's fault (a StateError everywhere); any other kind: another failure
  // (an hddp::Error on the other ranks).
  RankOutcome said;
  try {
    work();
  } catch (...) {
    error = std::current_exception();
    said = currentFailure();
  }
  if (said.failure == FailureKind::Foreign) {
    // What LibTorch (or the standard library) refused in the file's contents.
    try {
      HDDP_THROW(StateError, "cannot resume from ", path,
                 ": LibTorch refused what the state file holds (", said.message,
                 "); it is damaged or not hddp's. Resume from an earlier state file.");
    } catch (const StateError& e) {
      error = std::current_exception();
      said = {FailureKind::State, e.what_without_backtrace()};
    }
  }
  const auto all = allgatherOutcomes(comm, said);
  if (error) {
    std::rethrow_exception(error);
  }
  const int r = firstFailed(all);
  if (r >= 0) {
    const RankOutcome& other = all[static_cast<size_t>(r)];
    if (other.failure == FailureKind::State) {
      HDDP_THROW(StateError, "loading ", path, " failed on rank ", r, ": ", other.message);
    }
    HDDP_THROW(Error, "loading ", path, " failed on rank ", r, ": ", other.message);
  }
}

void readModelAndOptimizer(const StateParts& parts, InputArchive& archive, const std::string& path,
                           SharedPart& out) {
  asModelOrOptimizerError(path, [&] {
    auto copyInto = [&](const std::string& key, const at::Tensor& target) {
      at::Tensor saved;
      HDDP_CHECK_AS(StateError, archive.try_read(key, saved), "state file ", path, " has no '", key,
                    "': it was saved from a different model");
      HDDP_CHECK_AS(StateError, saved.sizes() == target.sizes(), "state file ", path, ": '", key,
                    "' has shape ", saved.sizes(), ", the model's is ", target.sizes());
      out.copies.emplace_back(target, saved);
    };
    for (const auto& item : parts.model.named_parameters(/*recurse=*/true)) {
      copyInto("model." + item.key(), item.value());
    }
    for (const auto& item : parts.model.named_buffers(/*recurse=*/true)) {
      copyInto("buffer." + item.key(), item.value());
    }
    InputArchive zero;
    const bool sharded = archive.try_read("zero", zero);
    if (parts.sharded) {
      HDDP_CHECK_AS(StateError, sharded, "state file ", path,
                    " holds a whole optimizer (saved without --zero); resume it with --zero 0");
      at::Tensor count;
      zero.read("parts", count);
      for (int64_t r = 0; r < count.item<int64_t>(); ++r) {
        at::Tensor bytes;
        zero.read("part" + std::to_string(r), bytes);
        HDDP_CHECK_AS(StateError, bytes.scalar_type() == at::kByte, "state file ", path,
                      ": its ZeRO optimizer part ", r, " is no byte tensor");
        const std::string part = tensorBytes(bytes);
        // Each part is an archive that ShardedOptimizer::loadShards hands to LibTorch.
        checkTorchArchive(part,
                          "state file " + path + ": its ZeRO optimizer part " + std::to_string(r));
        out.zeroParts.emplace_back(part.begin(), part.end());
      }
    } else {
      HDDP_CHECK_AS(StateError, !sharded, "state file ", path,
                    " holds an optimizer sharded by ZeRO (saved with --zero 1 or 2); resume "
                    "it with --zero 1 or 2 (any number of ranks and shares)");
      readArchive(archive, "optimizer", out.optimizer, path);
    }
    readArchive(archive, "scaler", out.scaler, path);
    GradScaler().load(out.scaler);  // checked on a scaler of its own: nothing changes yet
  });
}

// Model, buffers, optimizer and scaler: copied into what the Trainer already holds.
void applyModelAndOptimizer(const StateParts& parts, SharedPart& in, const std::string& path) {
  asModelOrOptimizerError(path, [&] {
    {
      torch::NoGradGuard noGrad;
      for (auto& [target, saved] : in.copies) {
        target.copy_(saved);
      }
    }
    if (parts.sharded) {
      parts.sharded->loadShards(in.zeroParts);
    } else {
      parts.optimizer.load(in.optimizer);
      moveOptimizerStateToParameters(parts.optimizer);
    }
    parts.scaler.load(in.scaler);
  });
}

}  // namespace train
}  // namespace hddp
