// A Trainer state file's load (trainer_state.h's loadState): the commit chosen among the
// ranks' folders, the model, optimizer and scaler copied into what the Trainer holds, each
// rank's own part (RNGs, planner, PowerSGD) remapped when the members changed.
#include <ATen/core/Generator.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <vector>

#include "ddp/ddp_access.h"
#include "hddp/amp/grad_scaler.h"
#include "hddp/balance/compression_model.h"
#include "hddp/balance/planner.h"
#include "hddp/comm/communicator.h"
#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/power_sgd.h"
#include "hddp/ddp/sharded_optimizer.h"
#include "hddp/train/state_file.h"
#include "train/archive_check.h"
#include "train/commit_folders.h"
#include "train/elastic.h"
#include "train/state_archive.h"
#include "train/trainer_state.h"

namespace hddp {
namespace train {
namespace {

InputArchive savedBlob(InputArchive& file, int64_t index, const std::string& path) {
  const std::string key = "rank" + std::to_string(index);
  const std::string bytes = tensorBytes(readTensor(file, key, path));
  InputArchive blob;
  loadArchive(blob, bytes, "state file " + path + ": its '" + key + "'", std::nullopt);
  return blob;
}

// Who saved each rank's part of the file (its slot, or -(rank + 1)).
std::vector<int64_t> savedMembers(InputArchive& file, int64_t savedRanks, const std::string& path) {
  std::vector<int64_t> saved;
  for (int64_t i = 0; i < savedRanks; ++i) {
    InputArchive blob = savedBlob(file, i, path);
    at::Tensor member;
    saved.push_back(blob.try_read("member", member) ? member.item<int64_t>() : -(i + 1));
  }
  return saved;
}

// For each rank of this job, the saved rank it continues (the same member: slot or
// rank), -1 for a newcomer; `saved` is savedMembers() of the file. Collective.
std::vector<int> matchMembers(const StateParts& parts, const std::vector<int64_t>& saved) {
  const std::string bytes = std::to_string(memberId(parts));
  const auto all = parts.comm.allgatherBytes(std::vector<uint8_t>(bytes.begin(), bytes.end()));
  std::vector<int> from;
  for (const auto& b : all) {
    const int64_t id = std::stoll(std::string(b.begin(), b.end()));
    const auto it = std::find(saved.begin(), saved.end(), id);
    from.push_back(it == saved.end() ? -1 : static_cast<int>(it - saved.begin()));
  }
  return from;
}

// PowerSGD's state from a saved rank's part. The step and the Q memories are the same
// on every rank; the error memories are the rank's own, in units of its 1/n part of the
// sum: where the group changed they no longer fit and start from zero (logged). A file
// saved without PowerSGD leaves the hook to start fresh.
void loadPowerSgd(PowerSgdState& state, InputArchive& saved, bool sameGroup, int ranks,
                  int64_t savedRanks) {
  InputArchive archive;
  if (!saved.try_read("powersgd", archive)) {
    HDDP_LOG_INFO("train", "the state file holds no PowerSGD state: it starts afresh");
    return;
  }
  std::vector<std::pair<std::string, at::Tensor>> items;
  bool droppedErrors = false;
  for (const auto& key : archive.keys()) {
    if (!sameGroup && (key.rfind("error/", 0) == 0 || key.rfind("error.", 0) == 0)) {
      droppedErrors = true;
      continue;
    }
    at::Tensor t;
    archive.read(key, t);
    items.emplace_back(key, t);
  }
  state.loadStateDict(items);
  if (droppedErrors) {
    HDDP_LOG_INFO("train", "PowerSGD: saved by ", savedRanks, " ranks, resumed by ", ranks,
                  " in another group: error memories start from zero (Q memories and the "
                  "step count go on)");
  }
}

// This rank's own part: its RNGs from the saved rank it continues (none for a newcomer,
// which keeps its own), then the planner, remapped when the members changed.
void loadRankBlob(const StateParts& parts, InputArchive& file, InputArchive* plannerShared,
                  const std::vector<int>& from, int64_t savedRanks, const std::string& path) {
  const int source = from[static_cast<size_t>(parts.comm.rank())];
  bool same = savedRanks == static_cast<int64_t>(from.size());
  for (size_t r = 0; r < from.size(); ++r) {
    same = same && from[r] == static_cast<int>(r);
  }
  InputArchive mine;
  InputArchive own;
  const bool hasOwn = source >= 0;
  if (hasOwn) {
    mine = savedBlob(file, source, path);
    setGeneratorState(at::detail::getDefaultCPUGenerator(), readTensor(mine, "cpu_rng", path));
    const c10::Device device = parts.device;
    at::Tensor deviceRng;
    if (device.type() != c10::kCPU && mine.try_read("device_rng", deviceRng)) {
      setGeneratorState(at::globalContext().defaultGenerator(device), deviceRng);
    }
  }
  if (parts.planner && plannerShared) {
    if (hasOwn) {
      readArchive(mine, "planner", own, path);
    }
    if (same) {
      parts.planner->load(*plannerShared, own);
    } else {
      parts.planner->loadRemapped(*plannerShared, hasOwn ? &own : nullptr, from);
    }
  }
  if (parts.powerSgd) {
    if (hasOwn) {
      loadPowerSgd(*parts.powerSgd, mine, same, static_cast<int>(from.size()), savedRanks);
    } else {  // a newcomer: the step and Q memories are rank 0's as everyone's
      InputArchive first = savedBlob(file, 0, path);
      loadPowerSgd(*parts.powerSgd, first, same, static_cast<int>(from.size()), savedRanks);
    }
  }
}

// A state file named by the user: rank 0 checks it and tells the others (its error
// reaches every rank, so none waits for the others until a timeout).
std::string chooseStateFile(Communicator& comm, const std::string& file) {
  std::string problem;
  if (comm.rank() == 0) try {
      readStateFile(file);
    } catch (const c10::Error& e) {
      problem = e.what_without_backtrace();
    } catch (const std::exception& e) {  // bad_alloc: the others must still hear of it
      problem = e.what();
    }
  const std::string mine = problem.empty() ? file : "!" + problem;
  const auto all = comm.allgatherBytes(std::vector<uint8_t>(mine.begin(), mine.end()));
  const std::string decided(all[0].begin(), all[0].end());
  HDDP_CHECK_AS(StateError, decided.empty() || decided[0] != '!',
                "cannot resume: ", decided.substr(decided.empty() ? 0 : 1));
  return decided;
}

// Whether `path` names one file (rank 0's view, so that every rank takes the same way):
// a name ending in .hddp, or an existing file that is not a folder.
bool namesAFile(Communicator& comm, const std::string& path) {
  std::error_code ec;
  const bool file = std::filesystem::path(path).extension() == ".hddp" ||
                    (std::filesystem::exists(path, ec) && !std::filesystem::is_directory(path, ec));
  const auto all = comm.allgatherBytes({static_cast<uint8_t>(file ? 1 : 0)});
  return all[0].at(0) == 1;
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

// Model, buffers, optimizer and scaler: copied into what the Trainer already holds.
void loadModelAndOptimizer(const StateParts& parts, InputArchive& archive,
                           const std::string& path) {
  try {
    torch::NoGradGuard noGrad;
    auto copyInto = [&](const std::string& key, at::Tensor target) {
      at::Tensor saved;
      HDDP_CHECK_AS(StateError, archive.try_read(key, saved), "state file ", path, " has no '", key,
                    "': it was saved from a different model");
      HDDP_CHECK_AS(StateError, saved.sizes() == target.sizes(), "state file ", path, ": '", key,
                    "' has shape ", saved.sizes(), ", the model's is ", target.sizes());
      target.copy_(saved);
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
      std::vector<std::vector<uint8_t>> optimizerParts;
      for (int64_t r = 0; r < count.item<int64_t>(); ++r) {
        at::Tensor bytes;
        zero.read("part" + std::to_string(r), bytes);
        HDDP_CHECK_AS(StateError, bytes.scalar_type() == at::kByte, "state file ", path,
                      ": its ZeRO optimizer part ", r, " is no byte tensor");
        const std::string part = tensorBytes(bytes);
        // Each part is an archive that ShardedOptimizer::loadShards hands to LibTorch.
        checkTorchArchive(part,
                          "state file " + path + ": its ZeRO optimizer part " + std::to_string(r));
        optimizerParts.emplace_back(part.begin(), part.end());
      }
      parts.sharded->loadShards(optimizerParts);
    } else {
      HDDP_CHECK_AS(StateError, !sharded, "state file ", path,
                    " holds an optimizer sharded by ZeRO (saved with --zero 1 or 2); resume "
                    "it with --zero 1 or 2 (any number of ranks and shares)");
      InputArchive optimizerArchive;
      readArchive(archive, "optimizer", optimizerArchive, path);
      parts.optimizer.load(optimizerArchive);
      moveOptimizerStateToParameters(parts.optimizer);
    }
    InputArchive scalerArchive;
    readArchive(archive, "scaler", scalerArchive, path);
    parts.scaler.load(scalerArchive);
  } catch (const StateError&) {
    throw;
  } catch (const c10::Error& e) {
    HDDP_THROW(StateError, "state file ", path,
               " does not fit this model or optimizer: ", e.what_without_backtrace());
  }
}

// The compression the file was trained with, against this run's: adopted when
// `--compress auto` chose this run's (see StateParts::adoptCompression), else logged.
StateParts adoptSavedCompression(const StateParts& parts, InputArchive& file,
                                 const std::string& path) {
  StateParts out = parts;
  at::Tensor bytes;
  if (!file.try_read("compression", bytes)) {
    return out;
  }
  const std::string saved = tensorBytes(bytes);
  if (saved == parts.compression) {
    return out;
  }
  const bool savedPowerSgd = saved.rfind("powersgd", 0) == 0;
  if (parts.adoptCompression != nullptr && parts.ddp != nullptr && saved != "hook") {
    const CompressionSpec spec = CompressionSpec::parse(saved, path + ": compression");
    PowerSgdOptions o = *parts.adoptCompression;
    o.rank = spec.rank;
    const GradCompression c = gradCompressionOf(spec);
    try {
      parts.ddp->setCompression(c, o);
    } catch (const ConfigError& e) {  // steps have run in this process: too late to switch
      HDDP_LOG_SHARED("train", parts.comm.rank(), path, " was trained with --compress ", saved,
                      "; this run sends ", parts.compression, " and cannot switch now (",
                      e.what_without_backtrace(), ")",
                      savedPowerSgd ? ": the file's PowerSGD memories are not used" : "");
      return out;
    }
    out.powerSgd = parts.ddp->powerSgdState().get();
    out.compression = saved;
    HDDP_LOG_SHARED("train", parts.comm.rank(), path, " was trained with --compress ", saved,
                    ": the run goes on with it (--compress auto chose ", parts.compression,
                    " now; a choice made once stays, so that nothing it keeps is lost)");
    return out;
  }
  HDDP_LOG_SHARED("train", parts.comm.rank(), path, " was trained with --compress ", saved,
                  "; this run sends ", parts.compression,
                  savedPowerSgd ? ", so the file's PowerSGD memories (error feedback, Q) are "
                                  "not used"
                                : "");
  return out;
}

}  // namespace

LoadedState loadState(const StateParts& parts, const std::string& fileOrDirectory,
                      int64_t globalBatch, const LoadOptions& options) {
  LoadedState loaded;
  std::string payload;
  if (namesAFile(parts.comm, fileOrDirectory)) {
    // One file, named: every rank reads it (rank 0 checks it first).
    loaded.path = chooseStateFile(parts.comm, fileOrDirectory);
  } else {
    // A folder: the newest commit of the ranks' folders, sent to those without it.
    // The save folder's groups are kept for the saves that follow.
    // `options.keep` is the same on every rank (LoadOptions); whether a cache is stale is
    // agreed, so every rank runs folderGroups' exchanges or none does.
    FolderGroups found;
    FolderGroups& groups = options.keep && parts.folders ? *parts.folders : found;
    if (agreeAny(parts.comm, groups.empty() || groups.dir != fileOrDirectory)) {
      groups = folderGroups(parts.comm, fileOrDirectory, options.keep);
    }
    std::function<bool(const std::string&)> ofThisJob;
    if (!options.onlyRunId.empty()) {
      ofThisJob = [&options](const std::string& bytes) {
        InputArchive file;
        loadArchive(file, bytes, "state file", c10::Device(c10::kCPU));
        at::Tensor id;
        return file.try_read("run_id", id) && tensorBytes(id) == options.onlyRunId;
      };
    }
    // One commit's copies in several folders differ in their writers' clocks: they are
    // told apart by the id every writer wrote (files without one, by their bytes).
    const auto commitId = [](const std::string& bytes) -> uint64_t {
      InputArchive file;
      loadArchive(file, bytes, "state file", c10::Device(c10::kCPU));
      at::Tensor id;
      if (file.try_read("commit_id", id) && id.numel() == 1 && id.scalar_type() == at::kLong) {
        return static_cast<uint64_t>(id.item<int64_t>());
      }
      return crc32Of(bytes.data(), bytes.size());
    };
    ChosenCommit chosen = chooseCommit(parts.comm, groups, ofThisJob, options.keep, commitId);
    loaded.path = chosen.path;
    payload = std::move(chosen.payload);
  }
  const std::string& path = loaded.path;
  if (path.empty()) {
    return loaded;  // an empty or missing folder: nothing to resume
  }
  // Read and applied on each rank, then agreed: a rank that cannot read the file (one not
  // visible on its node) or whose load fails throws, and the others learn it at once
  // instead of waiting for it in matchMembers' exchange.
  InputArchive archive;
  InputArchive plannerShared;
  bool hasPlanner = false;
  std::vector<int64_t> members;  // who saved each rank's part
  agreeOutcome<StateError>(parts.comm, "loading " + path, [&] {
    if (payload.empty()) try {
        payload = readStateFile(path);
      } catch (const StateError&) {
        if (parts.comm.rank() != 0) {
          HDDP_LOG_ERROR("train", "rank ", parts.comm.rank(), " cannot read ", path,
                         ": the state file must be visible to every rank");
        }
        throw;
      }
    // Every tensor onto the host first: the file holds rank 0's optimizer state on rank
    // 0's device (cuda:0, emu:0), which this rank may not have or not use.
    // Checked before LibTorch reads it (its unpickler believes the sizes in the bytes);
    // LibTorch's own errors (a payload that is no archive, code that does not parse) as a
    // StateError naming the file, which the others learn too.
    loadArchive(archive, payload, "state file " + path, c10::Device(c10::kCPU));
    loaded.meta = decode(readTensor(archive, "meta", path), path);
    at::Tensor progress;
    if (archive.try_read("progress", progress) && progress.numel() == 7) {
      const at::Tensor p = progress.to(at::kDouble).contiguous();
      const double* v = p.data_ptr<double>();
      // A count beyond int64 would be converted out of range (undefined behaviour).
      const auto count = [&path](double x) {
        HDDP_CHECK_AS(StateError, x >= -9.0e18 && x <= 9.0e18, "state file ", path,
                      ": its progress record holds a count of ", x,
                      "; resume from an earlier state file");
        return static_cast<int64_t>(x);
      };
      StateMeta::Progress& g = loaded.meta.progress;
      g.epochLossSum = v[0];
      g.epochSamples = count(v[1]);
      g.epochSteps = count(v[2]);
      g.budgetSeconds = v[3];
      g.budgetEvaluationSeconds = v[4];
      g.budgetStartStep = count(v[5]);
      g.budgetSteps = count(v[6]);
      g.present = true;
    }
    HDDP_CHECK_AS(StateError, loaded.meta.globalBatch == globalBatch, "state file ", path,
                  " was saved with global batch ", loaded.meta.globalBatch, "; this job uses ",
                  globalBatch, ". Resume with the same global batch.");
    loadModelAndOptimizer(parts, archive, path);
    loaded.sampler = DistributedSampler::State::load(archive);
    hasPlanner = parts.planner && archive.try_read("planner", plannerShared);
    members = savedMembers(archive, loaded.meta.worldSize, path);
  });
  const StateMeta& meta = loaded.meta;
  if (parts.planner && !hasPlanner) {
    HDDP_LOG_SHARED("train", parts.comm.rank(), path,
                    " was saved with the equal split: the planner starts afresh");
  }
  const std::vector<int> from = matchMembers(parts, members);
  if (meta.worldSize != parts.comm.size() || std::count(from.begin(), from.end(), -1) > 0) {
    std::string map;
    for (size_t r = 0; r < from.size(); ++r) {
      map += (r ? ", " : "") + std::to_string(r) + "<-" +
             (from[r] < 0 ? std::string("new") : std::to_string(from[r]));
    }
    HDDP_LOG_SHARED("train", parts.comm.rank(), path, " was saved by ", meta.worldSize,
                    " ranks; it loads into ", parts.comm.size(), " (rank<-saved rank: ", map,
                    "); the sampler goes on with the same global order");
  }
  // Each rank's own part (its saved rank's blob) and what DDP adopts, agreed as above.
  agreeOutcome<StateError>(parts.comm, "loading " + path, [&] {
    const StateParts adopted = adoptSavedCompression(parts, archive, path);
    loaded.compression = adopted.compression;
    loadRankBlob(adopted, archive, hasPlanner ? &plannerShared : nullptr, from, meta.worldSize,
                 path);
    at::Tensor order;
    if (parts.ddp && archive.try_read("ddp_order", order)) {
      std::vector<std::string> names;
      std::istringstream lines(tensorBytes(order));
      for (std::string name; std::getline(lines, name);) {
        names.push_back(name);
      }
      if (!detail::DdpAccess::adoptBucketOrder(*parts.ddp, names)) {
        // PowerSGD's memories are per parameter: they still fit where the shapes do.
        HDDP_LOG_SHARED("train", parts.comm.rank(), path,
                        ": its bucket order does not name this model's parameters; DDP keeps "
                        "its own");
      }
    }
  });
  return loaded;
}

}  // namespace train
}  // namespace hddp
