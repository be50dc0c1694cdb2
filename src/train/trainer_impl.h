// The Trainer's loop and the parts it runs (internal to the train layer). trainer.cpp
// builds the parts and runs fit()'s start and end; epoch.cpp an epoch; step.cpp one
// step in phases. The parts: balancing (train/balancing.h), the compression choice
// (train/compression_choice.h), out-of-memory recovery (hddp/train/out_of_memory.h), the
// time budget (hddp/train/time_budget.h), the launcher's protocol (train/elastic.h),
// reporting (train/reporter.h, hddp/train/timeline.h), the program's own parts
// (train/part_list.h); state files in trainer_state.h.
#pragma once

#include <memory>
#include <string>

#include "hddp/train/out_of_memory.h"
#include "hddp/train/step_rollback.h"
#include "hddp/train/time_budget.h"
#include "hddp/train/timeline.h"
#include "hddp/train/trainer.h"
#include "train/balancing.h"
#include "train/commit_folders.h"
#include "train/compression_choice.h"
#include "train/elastic.h"
#include "train/loop_state.h"
#include "train/part_list.h"
#include "train/reporter.h"
#include "train/trainer_state.h"

namespace hddp {

class Trainer::Impl {
 public:
  using Clock = train::LoopClock;

  Impl(Communicator& comm, std::shared_ptr<torch::nn::Module> model, ForwardFn forward, LossFn loss,
       torch::optim::Optimizer& optimizer, std::shared_ptr<const Dataset> train,
       TrainerOptions options);
  ~Impl();

  TrainSummary fit();
  std::string save();
  /// Loads a state file, or the newest commit of a folder (the ranks' own folders where
  /// they differ); false when there was none.
  bool load(const std::string& fileOrDirectory, const train::LoadOptions& options = {});
  /// Throws hddp::Error when a load failed part-way (halfLoaded_).
  void checkWhole() const;
  /// The planner's plan, or the equal split without balancing.
  BatchPlan currentPlan() const { return balance_->plan(options_.globalBatch); }

  // ---- building (trainer_build.cpp) ----------------------------------------------------
  /// The options resolved and checked (every rank's problem fails every rank), agreed.
  void resolveAndAgreeOptions(Communicator& comm, const Dataset* train);
  /// DDP over the model (an emulated slower card sends each bucket when it would have
  /// computed it), the seed, the compression choice, ZeRO, the planner.
  void buildDdpAndBalancing(const Dataset& train);
  /// TrainerOptions::zero > 0: shards the optimizer (sharded_) by options_.shardBy.
  void shardOptimizer();

  // ---- fit()'s start and end (trainer.cpp, trainer_resume.cpp) -------------------------
  /// Faults armed, the launcher's marks agreed, the parts' names, the resume, the output
  /// files opened (agreed), the parts started.
  void startFit();
  /// fit()'s resume: the given `resume`, or on a launcher's restart the newest commit.
  void resumeForFit();
  bool agreedFolders();
  /// The run ended inside an epoch: what was trained evaluated and saved.
  void endInsideEpoch(TrainSummary& summary);
  TrainSummary finishFit(TrainSummary summary);

  // ---- an epoch (epoch.cpp) ------------------------------------------------------------
  /// How an epoch ended: complete (the run goes on), on the run's last step (maxSteps or
  /// the budget at the epoch's end), or stopped inside (a resume continues it).
  enum class EpochEnd { Complete, StopsTheRun, Stopped };
  /// One epoch (or the rest of one), its end, evaluation and state file.
  EpochEnd runEpoch(TrainSummary& summary);
  /// Whether the run ends before the next step (maxSteps, the budget, a part's request).
  bool runEnds() const;
  /// The user's evaluation, timed; an empty result keeps the last one.
  std::map<std::string, double> evaluate();
  void endEpoch(Clock::time_point epochStart, int64_t epochSteps, TrainSummary& summary);
  /// Steps planned in all (StepInfo::totalSteps).
  int64_t plannedSteps() const;
  nlohmann::json runConfig() const;

  // ---- one step (step.cpp) -------------------------------------------------------------
  /// The time points of one step, as its phases end.
  struct StepClock {
    Clock::time_point start;
    Clock::time_point forwardEnd;
    Clock::time_point backwardEnd;
    Clock::time_point end;
  };
  /// Runs one step; false when it was abandoned (some rank ran out of memory): nothing
  /// was applied, and the loader serves the same samples again under a new split.
  bool runStep(const Batch& batch);
  /// Forward and the scaled backward (the allreduce overlaps it); with recovery_, a rank
  /// that runs out of memory gives the step up.
  void forwardAndBackward(const Batch& batch, StepClock& clock);
  /// After an abandoned step: learn the memory caps, re-plan, rewind the loader.
  void repeatStep(const Batch& batch, Clock::time_point start);
  /// Unscale, clip, step (skipped on every rank on an fp16 overflow), update the scale.
  bool optimizerStep(const Batch& batch, StepClock& clock);
  /// This rank's memory and compute seconds, given to the planner, which may re-split.
  double measureAndReplan(int64_t localBatch);
  /// Returns this rank's loss (its share's mean; 0 without samples).
  double report(const Batch& batch, const StepInfo& info, const StepClock& clock, double compute,
                bool stepped);

  // ---- state files (trainer_save.cpp) --------------------------------------------------
  train::StateParts stateParts();
  std::string saveMidEpoch();
  /// A state file's compression that the load put in place of this run's choice.
  void adoptCompression(const std::string& name);
  /// A commit: the state file, then its elastic part (ElasticRun::committed), which
  /// leaves the process with kReformExitCode when the group re-forms.
  void commit(TrainSummary& summary);

  // The given communicator under an emulated slow link (EmulationOptions::
  // collectiveBytesPerSecond, linkLatencySeconds), or null; comm_ is it when set.
  std::unique_ptr<Communicator> emulatedLink_;
  Communicator& comm_;
  // The program's: its model, forward, loss, optimizer, schedule and evaluation.
  std::shared_ptr<torch::nn::Module> model_;
  ForwardFn forward_;
  LossFn loss_;
  torch::optim::Optimizer& optimizer_;
  ScheduleFn schedule_;
  EvalFn evaluation_;
  const TrainerOptions given_;  // as the program gave them (Trainer::options())
  // As the Trainer runs them: resolveOptions(given_), then its later decisions (the
  // compression Auto chose, the one a state file brought back).
  TrainerOptions options_;
  c10::Device device_;
  bool hasSyncBatchNorm_ = false;

  // ---- the parts -----------------------------------------------------------------------
  // The launcher's protocol (elastic.h): sample log, progress mark, job record, commits.
  train::ElasticRun elastic_;
  std::unique_ptr<DistributedDataParallel> ddp_;
  // TrainerOptions::zero > 0: the optimizer cut down to this rank's shard (else null).
  std::unique_ptr<ShardedOptimizer> sharded_;
  std::unique_ptr<GradScaler> scaler_;
  std::unique_ptr<PrefetchLoader> loader_;
  std::unique_ptr<train::Balancing> balance_;
  train::CompressionChoice compression_;
  // A step's buffers and RNG before its forward, for a step that is abandoned or skipped
  // (set with out-of-memory recovery or the GradScaler).
  std::unique_ptr<StepRollback> rollback_;
  // Out-of-memory recovery (TrainerOptions::recoverFromOutOfMemory without SyncBatchNorm),
  // else null.
  std::unique_ptr<OutOfMemoryRecovery> recovery_;
  /// The time budget (TrainerOptions::timeBudgetSeconds), the job's: a launcher's
  /// restart carries it on.
  TimeBudget budget_;
  Timeline timeline_;
  train::Reporter reporter_;
  train::PartList parts_;  // the program's own (Trainer::addPart)
  // Which ranks share the save folder (found at the first save or resume).
  train::FolderGroups saveFolders_;
  // Why a load that failed part-way left this Trainer half loaded (empty: it did not);
  // the same on every rank. fit(), save() and load() then refuse (checkWhole()).
  std::string halfLoaded_;

  // ---- the loop's own state ------------------------------------------------------------
  int64_t step_ = 0;
  int64_t epoch_ = 0;
  train::RunState run_;
  train::EpochState thisEpoch_;
  train::LastStep lastStep_;
};

/// Seconds from `a` to `b` on the Trainer's clock.
inline double seconds(Trainer::Impl::Clock::time_point a, Trainer::Impl::Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace hddp
