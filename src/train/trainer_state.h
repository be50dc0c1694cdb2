// The Trainer's state files: what one holds and how it is written and read back
// (internal to the train layer; the file format itself is in hddp/train/state_file.h).
//
// A state file is a LibTorch archive:
//   meta            StateMeta as int64 [version, step, epoch, midEpoch, worldSize,
//                   globalBatch]
//   progress        StateMeta::Progress as float64 [epochLossSum, epochSamples,
//                   epochSteps, budgetSeconds, budgetEvaluationSeconds,
//                   budgetStartStep, budgetSteps] (optional: zeros when absent)
//   model.<name>    every parameter, buffer.<name> every buffer (copied into the
//                   module on load, so DDP's gradient hooks stay in place)
//   optimizer       the optimizer's own archive (without ZeRO)
//   zero            with ZeRO (--zero 1|2), instead of `optimizer`: parts (int64, the
//                   saving world size) and part<r>, rank r's ShardedOptimizer::saveShard
//                   bytes (its parameters' state, keyed by parameter index): any world
//                   size and shares load it
//   scaler          GradScaler::save
//   sampler         DistributedSampler::State::save (where the epoch's order stands)
//   planner         BatchPlanner::save, its shared part (with balancing only)
//   compression     what DDP sent ("none", "fp16", "powersgd:4", ...; optional)
//   ddp_order       DDP's parameters in bucket order, names separated by newlines
//                   (optional: a file without it leaves DDP's own order)
//   run_id          the launcher's job id (TORCHELASTIC_RUN_ID; optional): an agent's
//                   next generation resumes only its own job's commits
//   rank<r>         rank r's own archive, as bytes: its RNGs, its planner window and,
//                   with PowerSGD, the hook's state (step, Q memories, this rank's
//                   error memories); rank 0's also the Trainer's parts' states
//                   (trainer_parts, part_state.h; optional)
// Rank 0 writes it, and the lowest rank of each other folder when the ranks do not all
// share the save folder (commit_folders.h); every rank reads it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hddp/data/distributed_sampler.h"

namespace torch {
namespace nn {
class Module;
}  // namespace nn
namespace optim {
class Optimizer;
}  // namespace optim
}  // namespace torch

namespace hddp {

class BatchPlanner;
class Communicator;
class GradScaler;
class PowerSgdState;
class ShardedOptimizer;
struct PowerSgdOptions;
struct CompressionSpec;
enum class GradCompression;
class DistributedDataParallel;
class TrainerPart;

namespace train {

struct FolderGroups;

/// The scalar part of a state file ("meta").
struct StateMeta {
  /// Format version; a file of another version is refused with a StateError.
  static constexpr int64_t kVersion = 3;
  /// Optimizer steps done.
  int64_t step = 0;
  /// The epoch in progress (or the next to start).
  int64_t epoch = 0;
  /// Saved inside `epoch`: the sampler's position is where it continues.
  bool midEpoch = false;
  int64_t worldSize = 0;
  int64_t globalBatch = 0;
  /// The run between steps (the "progress" entry; absent in older files: zeros).
  struct Progress {
    /// The epoch so far, over every rank's samples (zeros at an epoch's boundary).
    double epochLossSum = 0;
    int64_t epochSamples = 0;
    int64_t epochSteps = 0;
    /// The time budget's account, the job's across restarts and re-formings: training
    /// seconds up to this state (each generation's fit(), re-forming not counted), of
    /// them in evaluations, the step the budget started at and the step at which it
    /// ends the run (0: not measured yet).
    double budgetSeconds = 0;
    double budgetEvaluationSeconds = 0;
    int64_t budgetStartStep = 0;
    int64_t budgetSteps = 0;
    /// The file had the entry (older files do not).
    bool present = false;
  } progress;
};

/// The Trainer's parts a state file holds (planner: null with the equal split).
struct StateParts {
  Communicator& comm;
  /// The rank's own device (its model's), whose RNG travels in the rank's part; not the
  /// communicator's, which is the CPU under Gloo whatever the rank computes on.
  c10::Device device;
  torch::nn::Module& model;
  torch::optim::Optimizer& optimizer;
  GradScaler& scaler;
  BatchPlanner* planner;
  /// The launcher's slot in an elastic job (LaunchInfo::slot; -1: none): who the rank
  /// is across generations, whose own part it takes at a resume.
  int slot = -1;
  /// DDP's PowerSGD state (GradCompression::PowerSgd), else null: in the rank's own part.
  PowerSgdState* powerSgd = nullptr;
  /// DDP, whose bucket order the file keeps (null: not kept): a resumed run gets the
  /// buckets of the run it continues, which PowerSGD's per-bucket memories need.
  DistributedDataParallel* ddp = nullptr;
  /// What DDP sends ("none", "fp16", "bf16", "powersgd:R", "hook"), kept in the file.
  std::string compression;
  /// Set when `--compress auto` made the choice: a file trained with another choice
  /// brings it back (DDP switched before its first step, these PowerSGD options with the
  /// file's rank), so that PowerSGD's memories carry on. Null: the choice is the user's,
  /// and a file made with another one says so in the log.
  const PowerSgdOptions* adoptCompression = nullptr;
  /// The launcher's job id (TORCHELASTIC_RUN_ID; empty: none), kept in the file.
  std::string runId;
  /// ZeRO: the sharded optimizer (null: the optimizer is whole on every rank). The file
  /// then holds every rank's part instead of one optimizer archive, and a load takes
  /// this rank's parameters out of all of them (any world size and shares).
  ShardedOptimizer* sharded = nullptr;
  /// Which ranks share the save folder (commit_folders.h), found at the first save to a
  /// folder and kept here for the next (null: found at each save).
  FolderGroups* folders = nullptr;
  /// The Trainer's parts (hddp/train/part.h); those with a state are kept in the file.
  std::vector<TrainerPart*> trainerParts;
  /// Set to true by loadState once it begins to change the parts (every entry it reads
  /// was read and checked on every rank before): a load that fails after that may have
  /// left them half loaded, alike on every rank. Null: not told.
  bool* partlyLoaded = nullptr;
};

/// The DDP compression `spec` names (its rank aside).
GradCompression gradCompressionOf(const CompressionSpec& spec);

/// Writes the state file of `meta.step` in `directory` (rank 0, and one rank of each
/// other folder where the ranks' folders differ; collective), keeping the newest
/// `keepLast` there. Returns the path.
std::string saveState(const StateParts& parts, const StateMeta& meta,
                      const DistributedSampler::State& sampler, const std::string& directory,
                      int keepLast);

struct LoadedState {
  std::string path;
  StateMeta meta;
  DistributedSampler::State sampler;
  /// What DDP sends after the load (the file's when it was adopted).
  std::string compression;
};

/// How a directory is resumed from.
struct LoadOptions {
  /// Only files whose run_id is this (empty: any file).
  std::string onlyRunId;
  /// The directory is the save folder: a folder without the newest commit keeps the copy
  /// it receives, and the folder groups found are kept for the saves that follow. Must be
  /// the same on every rank: decide it with an agreement (hddp/comm/exchange.h), never
  /// from this rank's paths alone (with a save folder per rank, `--resume fold0` is the
  /// save folder of rank 0 only).
  bool keep = false;
};

/// Loads `fileOrDirectory` (a directory: the newest valid state file of the ranks'
/// folders, which need not be shared: commit_folders.h)
/// into the parts (collective). A directory that is missing or holds no state file
/// loads nothing and returns an empty path; one whose state files are all invalid is
/// a StateError, as is a missing file (a path ending in .hddp). A file saved by another
/// number of ranks loads too: each rank continues the saved rank of its member (elastic
/// slot, else rank), newcomers start from the others' estimates. hddp::StateError when
/// the file was saved with another global batch, or does not fit the model or optimizer.
LoadedState loadState(const StateParts& parts, const std::string& fileOrDirectory,
                      int64_t globalBatch, const LoadOptions& options = {});

/// ZeRO's parts reach the folder writers only: each part goes out from its rank in chunks
/// (a broadcast per chunk on the communicator's device), so no device holds more than a
/// chunk of them, and a rank that does not write keeps none. Collective; every rank
/// returns one entry per rank, empty where it does not write.
std::vector<std::vector<uint8_t>> partsToWriters(Communicator& comm,
                                                 const std::vector<uint8_t>& mine, bool writer);

}  // namespace train
}  // namespace hddp
