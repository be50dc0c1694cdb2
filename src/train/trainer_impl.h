// The Trainer's parts and state (internal to the train layer). trainer.cpp builds the
// parts and runs the loop (epochs, evaluation, state files); step.cpp runs one step in
// phases. State files are in trainer_state.h, out-of-memory recovery in
// out_of_memory.h, metrics and progress in reporter.h.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "hddp/balance/compression_model.h"
#include "hddp/train/out_of_memory.h"
#include "hddp/train/step_rollback.h"
#include "hddp/train/time_budget.h"
#include "hddp/train/timeline.h"
#include "hddp/train/trainer.h"
#include "train/commit_folders.h"
#include "train/elastic.h"
#include "train/memory_meter.h"
#include "train/reporter.h"
#include "train/trainer_state.h"

namespace hddp {

namespace train {
/// What `ddp` sends for the gradients: "none", "fp16", "bf16", "powersgd:R", "hook".
std::string compressionName(const DdpOptions& ddp);
}  // namespace train
namespace train {

/// Tells a step timer of a communicator's waits (Communicator::addWaitObserver).
class TimerWaits final : public WaitObserver {
 public:
  explicit TimerWaits(StepTimer& timer) : timer_(timer) {}
  void beginWait() override { timer_.beginWait(); }
  void endWait() override { timer_.endWait(); }

 private:
  StepTimer& timer_;
};

}  // namespace train

class Trainer::Impl {
 public:
  using Clock = std::chrono::steady_clock;

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
  BatchPlan currentPlan() const;

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
  /// This rank's compute seconds, given to the planner, which may re-split.
  void measureMemory(int64_t local);
  double measureAndReplan();
  /// Returns this rank's loss (its share's mean; 0 without samples).
  double report(const Batch& batch, const StepInfo& info, const StepClock& clock, double compute,
                bool stepped);

  // ---- the loop (trainer.cpp) ----------------------------------------------------------

  /// How an epoch ended: complete (the run goes on), on the run's last step (maxSteps or
  /// the budget at the epoch's end), or stopped inside (a resume continues it).
  enum class EpochEnd { Complete, StopsTheRun, Stopped };
  /// fit()'s resume: the given `resume`, or on a launcher's restart the newest commit.
  void resumeForFit();
  bool agreedFolders();
  /// One epoch (or the rest of one), its end, evaluation and state file.
  EpochEnd runEpoch(TrainSummary& summary, int64_t& samples);

  void applyGivenMemoryCaps();
  /// Compute seconds per sample from a timed forward pass (for the seed).
  double timeForward(const Dataset& data);
  /// Every rank's cost before the first step (TrainerOptions::seedPlan).
  std::vector<RankCost> seedCosts(const Dataset& data, const EmulationOptions& emulation);
  /// The allreduce term from the seed's links (predictedAllreduceSeconds_), logged.
  void predictAllreduce(const std::vector<RankCost>& seed);
  /// TrainerOptions::zero > 0: shards the optimizer (sharded_) by options_.shardBy.
  void shardOptimizer();
  /// The gradients DDP reduces: the model's parameters with gradients, DDP's buckets.
  GradientLayout gradientLayout() const;
  /// GradCompression::Auto made a choice (options_.ddp) from the seed's slowest link and
  /// backward, and each rank's timed PowerSGD compute; logged with why.
  void resolveCompression(const std::vector<RankCost>& seed, const EmulationOptions& emulation);
  /// A state file's compression (`name`) that the load put in place of this run's choice:
  /// options_.ddp, compressionName_ and the allreduce's prediction follow it.
  void adoptCompression(const std::string& name);
  /// The user's evaluation, timed; an empty result keeps the last one.
  std::map<std::string, double> evaluate();
  void endEpoch(Clock::time_point epochStart, int64_t epochSteps, TrainSummary& summary);
  train::StateParts stateParts();
  std::string saveMidEpoch();

  // The given communicator under an emulated slow link (EmulationOptions::
  // collectiveBytesPerSecond, linkLatencySeconds), or null; comm_ is it when set.
  std::unique_ptr<Communicator> emulatedLink_;
  Communicator& comm_;
  std::shared_ptr<torch::nn::Module> model_;
  ForwardFn forward_;
  LossFn loss_;
  torch::optim::Optimizer& optimizer_;
  const TrainerOptions given_;  // as the program gave them (Trainer::options())
  // As the Trainer runs them: resolveOptions(given_), then its later decisions (the
  // compression Auto chose, the one a state file brought back).
  TrainerOptions options_;
  c10::Device device_;
  // The launcher's protocol (elastic.h): sample log, progress mark, job record, commits.
  train::ElasticRun elastic_;
  std::unique_ptr<DistributedDataParallel> ddp_;
  // TrainerOptions::zero > 0: the optimizer cut down to this rank's shard (else null).
  std::unique_ptr<ShardedOptimizer> sharded_;
  std::unique_ptr<BatchPlanner> planner_;
  std::unique_ptr<GradScaler> scaler_;
  std::unique_ptr<PrefetchLoader> loader_;
  std::unique_ptr<Emulator> emulator_;
  train::MemoryMeter memory_;
  std::unique_ptr<StepTimer> timer_;
  std::unique_ptr<train::TimerWaits> timerWaits_;  // the communicator's waits, on timer_
  RemovableHandle timerWaitsHandle_;
  ScheduleFn schedule_;
  EvalFn evaluation_;
  Timeline timeline_;
  train::Reporter reporter_;
  bool hasSyncBatchNorm_ = false;
  // The gradients' ring allreduce over the slowest rank's link, predicted from the seed
  // (0: not predicted): a time per step that no split of the batch changes.
  double predictedAllreduceSeconds_ = 0;
  // The same for the plain gradients (PowerSGD's steps before its start step send them).
  double predictedPlainAllreduceSeconds_ = 0;
  // What DDP sends for the gradients ("none", "fp16", "powersgd:4"; the metrics' config).
  std::string compressionName_;
  // GradCompression::Auto chose it (a resume then adopts a state file's choice).
  bool compressionChosen_ = false;
  // The seed's costs, by rank (empty without a seed): the allreduce's prediction again
  // when a resume changes the compression.
  std::vector<RankCost> seedCosts_;
  // Which ranks share the save folder (found at the first save or resume).
  train::FolderGroups saveFolders_;
  // Why a load that failed part-way left this Trainer half loaded (empty: it did not);
  // the same on every rank. fit(), save() and load() then refuse (checkWhole()).
  std::string halfLoaded_;
  // A step's buffers and RNG before its forward, for a step that is abandoned or skipped
  // (set with out-of-memory recovery or the GradScaler).
  std::unique_ptr<StepRollback> rollback_;
  // Out-of-memory recovery (TrainerOptions::recoverFromOutOfMemory without SyncBatchNorm),
  // else null.
  std::unique_ptr<OutOfMemoryRecovery> recovery_;

  int64_t step_ = 0;
  int64_t epoch_ = 0;

  /// This fit() (and what it reports in its summary).
  struct RunState {
    Clock::time_point start;
    int64_t startStep = 0;
    bool stoppedEarly = false;          // maxSteps or the time budget ended it inside the epochs
    bool resumed = false;               // it started from a state file
    bool restarted = false;             // load() runs for a launcher's restart of this job
    int64_t lastSaved = -1;             // the step of the newest state file
    Clock::time_point lastSaveStart{};  // when that save began
    int64_t repeatedSteps = 0;          // abandoned (out of memory) and trained again
    double peakMemory = 0;              // MemoryReading::peak() over the run
    double lastTrainLoss = 0;           // of the last complete epoch
    std::map<std::string, double> lastEvaluation;
  } run_;

  /// The epoch in progress (carried by a mid-epoch state file).
  struct EpochState {
    int64_t steps = 0;
    double lossSum = 0;  // over all ranks (rank 0 carries it)
    int64_t samples = 0;
    bool midEpoch = false;  // a resume continues inside the epoch, at `sampler`
    DistributedSampler::State sampler;
    double peakMemory = 0;  // MemoryReading::peak() over the epoch
  } thisEpoch_;

  /// What the step just run left for its report and the next step.
  struct LastStep {
    at::Tensor loss;              // undefined without samples
    bool newPlan = false;         // the planner changed the plan at the step's end
    train::MemoryReading memory;  // valid after a step with samples
    double transferSeconds = 0;   // the newest measured input transfer (0: none)
    double emulatedSeconds = 0;   // the emulator's sleep after the step (0: none)
  } lastStep_;
  bool learningRateUnknown_ = false;  // the optimizer's options have no get_lr()

  /// The time budget (TrainerOptions::timeBudgetSeconds), the job's: a launcher's
  /// restart carries it on.
  TimeBudget budget_;
  bool budgetCarry_ = false;  // load() takes the saved budget (a launcher's restart)

  /// Steps planned in all (StepInfo::totalSteps).
  int64_t plannedSteps() const;
  nlohmann::json runConfig() const;
  // ---- the program's parts (trainer_parts.cpp; hddp/train/part.h) --------------------
  void addPart(std::shared_ptr<TrainerPart> part);
  std::vector<TrainerPart*> partPointers() const;
  /// fit()'s start, before its resume: the parts' names agreed (one allgather).
  void agreePartNames();
  /// After the resume: the parts' onFitStart and the agreement on its outcome (one
  /// allreduce, with parts only).
  void startParts();
  /// Calls `hook` on every part in order; an exception is kept for agreeParts.
  template <typename Hook>
  void eachPart(Hook&& hook) {
    for (const auto& part : parts_) {
      try {
        hook(*part);
      } catch (...) {
        if (!partFailure_) {
          partFailure_ = std::current_exception();
          partFailureFrom_ = part->name();
        }
      }
    }
  }
  /// Every rank's requests (heldRequests_) and hook failures since the last agreement
  /// made everyone's (one 32-byte allreduce; nothing without parts): a failure throws on
  /// every rank, a stop is kept (partsStop_). Returns whether some rank asked to save.
  bool agreeParts();
  std::vector<std::shared_ptr<TrainerPart>> parts_;
  std::exception_ptr partFailure_;  // a hook's exception, until agreeParts
  std::string partFailureFrom_;     // the part that threw it
  bool partsStop_ = false;          // a part asked to stop the run (agreed)
  bool partsSave_ = false;          // a part asked to save after this step (agreed)
  bool partsEachStep_ = false;      // some part's agreesEachStep() (agreed)
  LoopRequests heldRequests_;       // this rank's requests since the last agreement
  bool fitting_ = false;            // fit() is running (addPart refuses)
  std::string partsStopWhy_;        // its reason (this rank's, or "on another rank")

  // ---- commits (trainer_commit.cpp) ----------------------------------------------------
  /// A commit: the state file, then its elastic part (ElasticRun::committed), which
  /// leaves the process with kReformExitCode when the group re-forms.
  void commit(TrainSummary& summary);
};

/// Seconds from `a` to `b` on the Trainer's clock.
inline double seconds(Trainer::Impl::Clock::time_point a, Trainer::Impl::Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace hddp
