// A Trainer state file's load (trainer_state.h's loadState): the commit chosen among the
// ranks' folders, the model, optimizer and scaler copied into what the Trainer holds, each
// rank's own part (RNGs, planner, PowerSGD) remapped when the members changed.
#include <ATen/core/Generator.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <new>
#include <sstream>
#include <vector>

#include "hddp/amp/grad_scaler.h"
#include "hddp/balance/compression_model.h"
#include "hddp/balance/planner.h"
#include "hddp/comm/communicator.h"
#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "hddp/ddp/power_sgd.h"
#include "hddp/ddp/sharded_optimizer.h"
#include "hddp/train/state_file.h"
#include "train/archive_check.h"
#include "train/commit_folders.h"
#include "train/elastic.h"
#include "train/part_state.h"
#include "train/state_archive.h"
#include "train/state_load_steps.h"
#include "train/trainer_state.h"

namespace hddp {
namespace train {
namespace {

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
  std::vector<int> from;
  for (const int64_t id : allgatherValue<int64_t>(parts.comm, memberId(parts))) {
    const auto it = std::find(saved.begin(), saved.end(), id);
    from.push_back(it == saved.end() ? -1 : static_cast<int>(it - saved.begin()));
  }
  return from;
}

// A state file named by the user: rank 0 checks it and tells the others (its error
// reaches every rank, so none waits for the others until a timeout).
std::string chooseStateFile(Communicator& comm, const std::string& file) {
  // Out of memory is no fault of the file's: an hddp::Error, not a StateError.
  RankOutcome mine;
  if (comm.rank() == 0) try {
      readStateFile(file);
    } catch (...) {  // the others must still hear of it
      mine = currentFailure();
    }
  if (!mine.failed()) {
    mine.message = file;  // rank 0's, which every rank takes
  }
  const RankOutcome decided = allgatherOutcomes(comm, mine)[0];
  HDDP_CHECK(decided.failure != FailureKind::OutOfMemory, "cannot resume from ", file,
             ": rank 0 failed while reading it (", decided.message, ")");
  HDDP_CHECK_AS(StateError, !decided.failed(), "cannot resume: ", decided.message);
  return decided.message;
}

// Whether `path` names one file (rank 0's view, so that every rank takes the same way):
// a name ending in .hddp, or an existing file that is not a folder.
bool namesAFile(Communicator& comm, const std::string& path) {
  std::error_code ec;
  const bool file = std::filesystem::path(path).extension() == ".hddp" ||
                    (std::filesystem::exists(path, ec) && !std::filesystem::is_directory(path, ec));
  return allgatherValue<uint8_t>(comm, file ? 1 : 0)[0] == 1;
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

// The id every writer of one commit wrote into its copy; 0 in a file without one (an
// older hddp's, whose writers' copies of one commit differ in their clocks).
uint64_t savedCommitId(InputArchive& file) {
  at::Tensor id;
  if (file.try_read("commit_id", id) && id.numel() == 1 && id.scalar_type() == at::kLong) {
    return static_cast<uint64_t>(id.item<int64_t>());
  }
  return 0;
}

// savedCommitId, or for a file without one its bytes' CRC: what tells commits apart.
uint64_t commitIdIn(InputArchive& file, const std::string& bytes) {
  const uint64_t id = savedCommitId(file);
  return id != 0 ? id : crc32Of(bytes.data(), bytes.size());
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
      return commitIdIn(file, bytes);
    };
    ChosenCommit chosen = chooseCommit(parts.comm, groups, ofThisJob, options.keep, commitId);
    loaded.path = chosen.path;
    payload = std::move(chosen.payload);
  }
  const std::string& path = loaded.path;
  if (path.empty()) {
    return loaded;  // an empty or missing folder: nothing to resume
  }
  // Read and checked on each rank, then agreed, before anything changes: a rank that
  // cannot read the file (one not visible on its node) or finds it wanting throws, and the
  // others learn it at once instead of waiting for it in matchMembers' exchange; the
  // Trainer stays as it was on every rank.
  InputArchive archive;
  SharedPart shared;
  InputArchive plannerShared;
  bool hasPlanner = false;
  uint64_t readId = 0;                     // the commit this rank read (0: a file without an id)
  std::vector<int64_t> members;            // who saved each rank's part
  std::vector<SavedPartState> partStates;  // the Trainer's parts' (part_state.h)
  agreeLoadStep(parts.comm, path, [&] {
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
    loaded.meta.progress = readProgress(archive, path);
    const StateMeta::Progress& g = loaded.meta.progress;
    // The time budget's account as TimeBudget::resume takes it, checked now: before
    // anything changes.
    HDDP_CHECK_AS(StateError,
                  !g.present || (std::isfinite(g.budgetSeconds) && g.budgetSeconds >= 0 &&
                                 std::isfinite(g.budgetEvaluationSeconds) &&
                                 g.budgetEvaluationSeconds >= 0 && g.budgetStartStep >= 0 &&
                                 g.budgetStartStep <= loaded.meta.step && g.budgetSteps >= 0),
                  "state file ", path, ": its time budget's account (", g.budgetSeconds, " s, ",
                  g.budgetEvaluationSeconds, " s evaluating, steps ", g.budgetStartStep, " to ",
                  g.budgetSteps, ") is not one hddp saves at step ", loaded.meta.step,
                  "; resume from an earlier state file");
    HDDP_CHECK_AS(StateError, loaded.meta.globalBatch == globalBatch, "state file ", path,
                  " was saved with global batch ", loaded.meta.globalBatch, "; this job uses ",
                  globalBatch, ". Resume with the same global batch.");
    readModelAndOptimizer(parts, archive, path, shared);
    loaded.sampler = DistributedSampler::State::load(archive);
    hasPlanner = parts.planner && archive.try_read("planner", plannerShared);
    readId = savedCommitId(archive);
    // Every saved rank's part is there and readable, whichever this rank continues.
    members = savedMembers(archive, loaded.meta.worldSize, path);
    // The parts' states travel in rank 0's part (part_state.h).
    InputArchive rank0 = savedBlob(archive, 0, path);
    partStates = readPartStates(rank0, parts.trainerParts, path, parts.comm.rank() == 0);
  });
  // Every rank read its own copy where the file was named (a node-local disk each): the
  // copies must be one commit, or the ranks would load different models, and what follows
  // (whether the planner's step runs) would differ from rank to rank. Files of an hddp
  // that wrote no commit id (every rank's 0) are told apart by the planner part only.
  const std::array<uint64_t, 2> read{readId, hasPlanner ? 1u : 0u};
  const auto all = allgatherValue(parts.comm, read);
  bool anyId = false;
  for (const auto& said : all) {
    anyId = anyId || said[0] != 0;
  }
  for (size_t r = 1; r < all.size(); ++r) {
    const bool same = all[r][1] == all[0][1] && (!anyId || all[r][0] == all[0][0]);
    HDDP_CHECK_AS(StateError, same, "rank ", r, " read another state file at ", path,
                  " than rank 0 (commit ", all[r][0], all[r][1] ? " with" : " without",
                  " a planner part, where rank 0's is ", all[0][0],
                  all[0][1] ? " with one" : " without one",
                  "): every rank must resume from the same file. Put it where every rank "
                  "reads the same bytes (a shared filesystem), or copy one file to every "
                  "node");
  }
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
  // Each rank's own part (its saved rank's blob), read and checked, agreed as above.
  OwnPart own;
  agreeLoadStep(parts.comm, path,
                [&] { own = readOwnPart(parts, archive, from, meta.worldSize, hasPlanner, path); });
  // The Trainer's parts, then the planner, agreed: where one failed on some rank, every
  // rank puts back the state they had, so that all go on alike.
  std::vector<std::string> partsBefore;
  try {
    agreeLoadStep(parts.comm, path, [&] {
      partsBefore = partStatesNow(partStates);
      applyPartStates(partStates);
    });
  } catch (...) {
    restorePartStates(partStates, partsBefore);
    throw;
  }
  if (parts.planner && hasPlanner) {
    const BatchPlanner::State before = parts.planner->state();
    try {
      agreeLoadStep(parts.comm, path, [&] { loadPlanner(parts, own, plannerShared, from); });
    } catch (...) {
      parts.planner->restore(before);
      restorePartStates(partStates, partsBefore);
      throw;
    }
  }
  // Then the rest, agreed too. What fails now (an optimizer's or a scaler's own load, the
  // memory the copies need) may leave the parts half loaded, on every rank alike:
  // `partlyLoaded` tells the Trainer.
  if (parts.partlyLoaded) {
    *parts.partlyLoaded = true;
  }
  try {
    agreeLoadStep(parts.comm, path, [&] {
      const StateParts adopted = adoptSavedCompression(parts, archive, path);
      loaded.compression = adopted.compression;
      applyOwnPart(adopted, own, from, meta.worldSize);
      applyModelAndOptimizer(parts, shared, path);
      at::Tensor order;
      if (parts.ddp && archive.try_read("ddp_order", order)) {
        std::vector<std::string> names;
        std::istringstream lines(tensorBytes(order));
        for (std::string name; std::getline(lines, name);) {
          names.push_back(name);
        }
        if (!parts.ddp->setBucketOrder(names)) {
          // PowerSGD's memories are per parameter: they still fit where the shapes do.
          HDDP_LOG_SHARED("train", parts.comm.rank(), path,
                          ": its bucket order does not name this model's parameters; DDP keeps "
                          "its own");
        }
      }
    });
  } catch (...) {
    restorePartStates(partStates, partsBefore);  // the program's objects, reused or not
    throw;
  }
  return loaded;
}

}  // namespace train
}  // namespace hddp
