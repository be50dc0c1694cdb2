// The Trainer's state files (internal to the train layer): what a save writes besides
// the parts' own state (the epoch so far, the time budget's account), and what a load
// restores and re-applies (memory caps given now, the budget on a launcher's restart).
// The file format itself is in trainer_state.h.
#include <torch/torch.h>

#include <array>
#include <chrono>
#include <new>
#include <string>
#include <vector>

#include "hddp/comm/exchange.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "train/trainer_impl.h"

namespace hddp {

train::StateParts Trainer::Impl::stateParts() {
  train::StateParts parts{comm_,           device_,
                          *model_,         optimizer_,
                          *scaler_,        balance_->planner(),
                          elastic_.slot(), ddp_->powerSgdState().get(),
                          ddp_.get()};
  parts.compression = compression_.name();
  parts.adoptCompression = compression_.chosen() ? &options_.ddp.powerSgd : nullptr;
  parts.runId = elastic_.runId();
  parts.folders = &saveFolders_;
  parts.sharded = sharded_.get();
  parts.trainerParts = parts_.pointers();
  return parts;
}

std::string Trainer::Impl::save() {
  checkWhole();
  HDDP_CHECK_AS(ConfigError, !options_.saveDir.empty(),
                "Trainer::save() needs TrainerOptions::saveDir");
  const auto t0 = Clock::now();
  run_.lastSaveStart = t0;
  train::StateMeta meta;
  meta.step = step_;
  meta.epoch = epoch_;
  meta.midEpoch = thisEpoch_.midEpoch;
  meta.worldSize = comm_.size();
  meta.globalBatch = options_.globalBatch;
  if (thisEpoch_.midEpoch) {
    // The epoch's loss so far over every rank's samples (each rank holds its own).
    const auto sums = reduceValues(
        comm_, std::array<double, 2>{thisEpoch_.lossSum, static_cast<double>(thisEpoch_.samples)});
    meta.progress.epochLossSum = sums[0];
    meta.progress.epochSamples = static_cast<int64_t>(sums[1]);
    meta.progress.epochSteps = thisEpoch_.steps;
  }
  const TimeBudget::Account budget = budget_.account();  // on the budget's clock
  meta.progress.budgetSeconds = budget.seconds;
  meta.progress.budgetEvaluationSeconds = budget.evaluationSeconds;
  meta.progress.budgetStartStep = budget.startStep;
  meta.progress.budgetSteps = budget.endStep;
  const DistributedSampler::State sampler =
      thisEpoch_.midEpoch ? thisEpoch_.sampler : DistributedSampler::State{epoch_, 0};
  const std::string path =
      train::saveState(stateParts(), meta, sampler, options_.saveDir, options_.keepLast);
  timeline_.add("save", t0, Clock::now(), step_);
  return path;
}

// A commit: the state file, then its elastic part (train::ElasticRun::committed,
// elastic.h).
void Trainer::Impl::commit(TrainSummary& summary) {
  summary.lastStateFile = saveMidEpoch();
  run_.lastSaved = step_;
  elastic_.committed(comm_, step_, summary.lastStateFile, run_.lastSaveStart);
}

std::string Trainer::Impl::saveMidEpoch() {
  thisEpoch_.sampler = loader_->state();
  thisEpoch_.midEpoch = true;
  const std::string path = save();
  thisEpoch_.midEpoch = false;
  return path;
}

void Trainer::Impl::checkWhole() const {
  HDDP_CHECK(halfLoaded_.empty(), "a state file failed to load part-way (", halfLoaded_,
             "): this Trainer's model, optimizer and other parts may be half loaded; construct "
             "a new Trainer (and model and optimizer) to go on");
}

bool Trainer::Impl::load(const std::string& fileOrDirectory, const train::LoadOptions& options) {
  checkWhole();
  train::LoadedState loaded;
  bool partlyLoaded = false;
  try {
    train::StateParts parts = stateParts();
    parts.partlyLoaded = &partlyLoaded;
    // What LibTorch refuses in a state file's contents is a StateError there (a file to
    // discard); running out of memory and a device's failure pass as they are.
    loaded = train::loadState(parts, fileOrDirectory, options_.globalBatch, options);
  } catch (const c10::Error& e) {
    if (partlyLoaded) {  // on every rank alike (loadState's steps are agreed)
      halfLoaded_ = e.what_without_backtrace();
    }
    throw;
  } catch (const std::exception& e) {
    if (partlyLoaded) {
      halfLoaded_ = e.what();
    }
    throw;
  }
  if (loaded.path.empty()) {
    if (options.onlyRunId.empty()) {
      HDDP_LOG_INFO("train", "no state file in ", fileOrDirectory,
                    " (missing or empty folder): starting fresh");
    }
    return false;
  }
  adoptCompression(loaded.compression);  // the file's, when --compress auto adopted it
  step_ = loaded.meta.step;
  epoch_ = loaded.meta.epoch;
  thisEpoch_.midEpoch = loaded.meta.midEpoch;
  thisEpoch_.sampler = loaded.sampler;
  run_.resumed = true;
  const train::StateMeta::Progress& progress = loaded.meta.progress;
  // The epoch so far: its sums are the whole group's, so one rank carries them.
  thisEpoch_.lossSum = thisEpoch_.midEpoch && comm_.rank() == 0 ? progress.epochLossSum : 0.0;
  thisEpoch_.samples = thisEpoch_.midEpoch && comm_.rank() == 0 ? progress.epochSamples : 0;
  thisEpoch_.steps = thisEpoch_.midEpoch ? progress.epochSteps : 0;
  if (run_.budgetCarry && progress.present) {
    // A restart of the same job: the budget and the schedule go on where they were.
    budget_.resume({progress.budgetSeconds, progress.budgetEvaluationSeconds,
                    progress.budgetStartStep, progress.budgetSteps},
                   step_);
  } else {
    budget_.start(step_);
  }
  // Caps given now win over the saved ones (a cap given again at resume replaces a
  // learned one, also upwards: how a learned cap is raised after a change of card or
  // model); a saved plan that breaks one is re-solved at once. On a launcher's restart
  // the same command line comes back: a cap learned since (out of memory) is lower and
  // stays.
  BatchPlanner* planner = balance_->planner();
  if (run_.restarted && planner) {
    const std::vector<int64_t> saved = planner->memoryCaps();
    for (int r = 0; r < comm_.size() && static_cast<size_t>(r) < options_.maxLocalBatch.size();
         ++r) {
      const int64_t given = options_.maxLocalBatch[static_cast<size_t>(r)];
      if (given > 0 && given < saved[static_cast<size_t>(r)]) {
        planner->setMemoryCap(r, given);
      }
    }
  } else {
    balance_->applyGivenMemoryCaps(options_);
  }
  HDDP_LOG_SHARED("train", comm_.rank(), "resumed from ", loaded.path, " at step ", step_,
                  ", epoch ", epoch_,
                  thisEpoch_.midEpoch
                      ? " (mid-epoch, sample " + std::to_string(thisEpoch_.sampler.position) + ")"
                      : std::string());
  return true;
}

}  // namespace hddp
