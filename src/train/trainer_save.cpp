// The Trainer's state files (internal to the train layer): what a save writes besides
// the parts' own state (the epoch so far, the time budget's account), and what a load
// restores and re-applies (memory caps given now, the budget on a launcher's restart).
// The file format itself is in trainer_state.h.
#include <torch/torch.h>

#include <chrono>
#include <string>
#include <vector>

#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "train/trainer_impl.h"

namespace hddp {

train::StateParts Trainer::Impl::stateParts() {
  return train::StateParts{comm_, device_, *model_, optimizer_, *scaler_, planner_.get()};
}

std::string Trainer::Impl::save() {
  HDDP_CHECK_AS(ConfigError, !options_.saveDir.empty(),
                "Trainer::save() needs TrainerOptions::saveDir");
  const auto t0 = Clock::now();
  lastSaveStart_ = t0;
  train::StateMeta meta;
  meta.step = step_;
  meta.epoch = epoch_;
  meta.midEpoch = midEpoch_;
  meta.worldSize = comm_.size();
  meta.globalBatch = options_.globalBatch;
  if (midEpoch_) {
    // The epoch's loss so far over every rank's samples (each rank holds its own).
    at::Tensor sums = at::tensor({epochLossSum_, static_cast<double>(epochSamples_)}, at::kDouble)
                          .to(comm_.device());
    comm_.allreduce(sums).wait();
    comm_.synchronize();  // the host reads it next (Communicator::synchronize)
    sums = sums.cpu();
    meta.progress.epochLossSum = sums[0].item<double>();
    meta.progress.epochSamples = static_cast<int64_t>(sums[1].item<double>());
    meta.progress.epochSteps = epochSteps_;
  }
  meta.progress.budgetSeconds =
      budgetSecondsBefore_ + (fitStart_ == Clock::time_point{}
                                  ? 0.0
                                  : std::chrono::duration<double>(t0 - fitStart_).count());
  meta.progress.budgetEvaluationSeconds = evaluationSeconds_;
  meta.progress.budgetStartStep = budgetStartStep_;
  meta.progress.budgetSteps = budgetSteps_;
  const DistributedSampler::State sampler =
      midEpoch_ ? samplerState_ : DistributedSampler::State{epoch_, 0};
  const std::string path =
      train::saveState(stateParts(), meta, sampler, options_.saveDir, options_.keepLast);
  timeline_.add("save", t0, Clock::now(), step_);
  return path;
}

std::string Trainer::Impl::saveMidEpoch() {
  samplerState_ = loader_->state();
  midEpoch_ = true;
  const std::string path = save();
  midEpoch_ = false;
  return path;
}

void Trainer::Impl::load(const std::string& fileOrDirectory) {
  const auto loaded = train::loadState(stateParts(), fileOrDirectory, options_.globalBatch);
  if (loaded.path.empty()) {
    HDDP_LOG_INFO("train", "no state file in ", fileOrDirectory,
                  " (missing or empty folder): starting fresh");
    return;
  }
  step_ = loaded.meta.step;
  epoch_ = loaded.meta.epoch;
  midEpoch_ = loaded.meta.midEpoch;
  samplerState_ = loaded.sampler;
  resumed_ = true;
  const train::StateMeta::Progress& progress = loaded.meta.progress;
  // The epoch so far: its sums are the whole group's, so one rank carries them.
  epochLossSum_ = midEpoch_ && comm_.rank() == 0 ? progress.epochLossSum : 0.0;
  epochSamples_ = midEpoch_ && comm_.rank() == 0 ? progress.epochSamples : 0;
  epochSteps_ = midEpoch_ ? progress.epochSteps : 0;
  if (carryBudget_ && progress.present) {
    // A restart of the same job: the budget and the schedule go on where they were.
    budgetSecondsBefore_ = progress.budgetSeconds;
    evaluationSeconds_ = progress.budgetEvaluationSeconds;
    budgetStartStep_ = progress.budgetStartStep;
    budgetSteps_ = progress.budgetSteps;
  } else {
    budgetSecondsBefore_ = 0;
    evaluationSeconds_ = 0;
    budgetStartStep_ = step_;
    budgetSteps_ = 0;
  }
  // Caps given now win over the saved ones (a cap given again at resume replaces a
  // learned one, also upwards: how a learned cap is raised after a change of card or
  // model); a saved plan that breaks one is re-solved at once. On a launcher's restart
  // the same command line comes back: a cap learned since (out of memory) is lower and
  // stays.
  if (restarted_ && planner_) {
    const std::vector<int64_t> saved = planner_->memoryCaps();
    for (int r = 0; r < comm_.size() && static_cast<size_t>(r) < options_.maxLocalBatch.size();
         ++r) {
      const int64_t given = options_.maxLocalBatch[static_cast<size_t>(r)];
      if (given > 0 && given < saved[static_cast<size_t>(r)]) {
        planner_->setMemoryCap(r, given);
      }
    }
  } else {
    applyGivenMemoryCaps();
  }
  HDDP_LOG_SHARED("train", comm_.rank(), "resumed from ", loaded.path, " at step ", step_,
                  ", epoch ", epoch_,
                  midEpoch_ ? " (mid-epoch, sample " + std::to_string(samplerState_.position) + ")"
                            : std::string());
}

}  // namespace hddp
