// The steps of a Trainer state file's load (internal to the train layer; loadState in
// trainer_state_load.cpp runs them): first what the file holds is read and checked on
// every rank and agreed (the shared entries, then this rank's own part), and only then is
// it applied, so that a file one rank cannot read or finds wanting leaves every rank's
// Trainer as it was.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "train/state_archive.h"
#include "train/trainer_state.h"

namespace hddp {

class Communicator;

namespace train {

// What a load reads of a rank's own part before it changes anything: the RNGs of the
// saved rank it continues (none for a newcomer, which keeps its own), its planner window,
// PowerSGD's state (a newcomer takes rank 0's step and Q memories as everyone's).
struct OwnPart {
  bool hasOwn = false;
  bool sameGroup = false;
  at::Tensor cpuRng;
  at::Tensor deviceRng;
  InputArchive planner;
  bool hasPowerSgd = false;
  bool droppedErrors = false;
  std::vector<std::pair<std::string, at::Tensor>> powerSgd;
};

// What a load copies into the model, the optimizer and the scaler, read and checked
// before any of them changes.
struct SharedPart {
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (the model's, the file's)
  std::vector<std::vector<uint8_t>> zeroParts;            // with ZeRO
  InputArchive optimizer;                                 // without
  InputArchive scaler;
};

/// Rank `index`'s own part of the file (its "rank<index>" archive).
InputArchive savedBlob(InputArchive& file, int64_t index, const std::string& path);

/// This rank's own part, read and checked (its RNG state on a generator of its own):
/// `from` is matchMembers' map, `savedRanks` the file's world size, `hasPlanner` whether
/// the planner loads (the file has its shared part and the job balances).
OwnPart readOwnPart(const StateParts& parts, InputArchive& file, const std::vector<int>& from,
                    int64_t savedRanks, bool hasPlanner, const std::string& path);
/// The planner from the shared `planner` entry and the own part (remapped where the
/// members changed); BatchPlanner checks everything it reads before it changes anything.
void loadPlanner(const StateParts& parts, OwnPart& own, InputArchive& shared,
                 const std::vector<int>& from);
/// The RNGs and PowerSGD's state (into parts.powerSgd, when there is one).
void applyOwnPart(const StateParts& parts, OwnPart& own, const std::vector<int>& from,
                  int64_t savedRanks);

/// The "progress" record (absent or malformed in older files: zeros, present = false).
StateMeta::Progress readProgress(InputArchive& archive, const std::string& path);

/// The model's, the optimizer's and the scaler's entries, read and checked against the
/// parts: a StateError naming what does not fit.
void readModelAndOptimizer(const StateParts& parts, InputArchive& archive, const std::string& path,
                           SharedPart& out);
/// Copies them into the model, the optimizer (its state then on each parameter's
/// device) and the scaler.
void applyModelAndOptimizer(const StateParts& parts, SharedPart& in, const std::string& path);

/// Runs one step of a load on this rank, then tells every rank how it went (one
/// allgather after `work`, on every rank), as agreeOutcome does. What LibTorch refuses in
/// the file's contents (a check of its own, a value out of a type's range) is the file's
/// fault: a StateError with LibTorch's words. Running out of memory (c10::OutOfMemoryError,
/// std::bad_alloc) and a device's failure (c10::AcceleratorError) are not: they pass as
/// they are, and the other ranks learn of them as an hddp::Error that is no StateError
/// (the file is good). `work` must run no collective.
void agreeLoadStep(Communicator& comm, const std::string& path, const std::function<void()>& work);

}  // namespace train
}  // namespace hddp
