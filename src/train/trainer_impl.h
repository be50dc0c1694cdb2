// The Trainer's parts and state (internal to the train layer). trainer.cpp builds the
// parts and runs the loop (epochs, evaluation, state files); step.cpp runs one step in
// phases. State files are in trainer_state.h, out-of-memory recovery in
// out_of_memory.h, metrics and progress in reporter.h.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>

#include "hddp/train/timeline.h"
#include "hddp/train/trainer.h"
#include "train/elastic.h"
#include "train/memory_meter.h"
#include "train/reporter.h"
#include "train/trainer_state.h"

namespace hddp {

class Trainer::Impl {
 public:
  using Clock = std::chrono::steady_clock;

  Impl(Communicator& comm, std::shared_ptr<torch::nn::Module> model, ForwardFn forward, LossFn loss,
       torch::optim::Optimizer& optimizer, std::shared_ptr<const Dataset> train,
       TrainerOptions options);
  ~Impl();

  TrainSummary fit();
  std::string save();
  void load(const std::string& fileOrDirectory);
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
  /// Forward and the scaled backward (the allreduce overlaps it). Returns this rank's
  /// allocation error when it ran out of memory and the step can be repeated, else "".
  std::string forwardAndBackward(const Batch& batch, StepClock& clock);
  /// After an abandoned step: learn the memory caps, re-plan, rewind the loader.
  void repeatStep(const Batch& batch, const std::string& mine, Clock::time_point start);
  /// Unscale, clip, step (skipped on every rank on an fp16 overflow), update the scale.
  bool optimizerStep(const Batch& batch, StepClock& clock);
  /// This rank's compute seconds, given to the planner, which may re-split.
  void measureMemory(int64_t local);
  double measureAndReplan();
  void report(const Batch& batch, const StepInfo& info, const StepClock& clock, double compute,
              bool stepped);

  // ---- the loop (trainer.cpp) ----------------------------------------------------------

  void applyGivenMemoryCaps();
  /// Compute seconds per sample from a timed forward pass (for the seed).
  double timeForward(const Dataset& data);
  /// Every rank's cost before the first step (TrainerOptions::seedPlan).
  std::vector<RankCost> seedCosts(const Dataset& data, const EmulationOptions& emulation);
  /// The allreduce term from the seed's links (predictedAllreduceSeconds_), logged.
  void predictAllreduce(const std::vector<RankCost>& seed);
  /// The user's evaluation, timed; an empty result keeps the last one.
  std::map<std::string, double> evaluate();
  void endEpoch(Clock::time_point epochStart, int64_t epochSteps, TrainSummary& summary);
  void barrier();
  train::StateParts stateParts();
  std::string saveMidEpoch();

  Communicator& comm_;
  std::shared_ptr<torch::nn::Module> model_;
  ForwardFn forward_;
  LossFn loss_;
  torch::optim::Optimizer& optimizer_;
  TrainerOptions options_;
  c10::Device device_;
  std::unique_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<BatchPlanner> planner_;
  std::unique_ptr<GradScaler> scaler_;
  std::unique_ptr<PrefetchLoader> loader_;
  std::unique_ptr<Emulator> emulator_;
  train::MemoryMeter memory_;
  train::MemoryReading lastMemory_;  // this step's (valid after a step with samples)
  double epochPeakMemory_ = 0;       // MemoryReading::peak() over the epoch, the run
  double runPeakMemory_ = 0;
  std::unique_ptr<StepTimer> timer_;
  bool hasSyncBatchNorm_ = false;
  ScheduleFn schedule_;
  EvalFn evaluation_;
  Timeline timeline_;
  train::Reporter reporter_;

  int64_t step_ = 0;
  int64_t epoch_ = 0;
  bool stoppedEarly_ = false;
  // The time budget (TrainerOptions::timeBudgetSeconds): the step at which it ends the
  // run (0: not measured yet), fit()'s start, and the seconds spent in evaluations.
  int64_t budgetSteps_ = 0;
  Clock::time_point fitStart_;
  int64_t fitStartStep_ = 0;
  double evaluationSeconds_ = 0;  // the budget's, the job's (carried by a restart)
  // The budget's training seconds before this fit() (carried by a restart), and the
  // step it started at.
  double budgetSecondsBefore_ = 0;
  int64_t budgetStartStep_ = 0;
  bool carryBudget_ = false;  // load() takes the saved budget (a launcher's restart)
  bool restarted_ = false;    // load() runs for a launcher's restart of this job
  int64_t epochSteps_ = 0;    // steps of the epoch in progress (carried mid-epoch)
  /// Steps planned in all (StepInfo::totalSteps).
  int64_t plannedSteps() const;
  nlohmann::json runConfig() const;
  /// Every 10 steps with a time budget: the ranks agree on the step that ends the run.
  void updateTimeBudget();
  bool midEpoch_ = false;
  bool resumed_ = false;
  int64_t lastSaved_ = -1;
  Clock::time_point lastSaveStart_{};  // when the last state file's save began
  int64_t repeatedSteps_ = 0;
  DistributedSampler::State samplerState_;
  at::Tensor stepLoss_;   // this step's loss (undefined without samples)
  bool newPlan_ = false;  // the planner changed the plan at the end of this step
  // The gradients' ring allreduce over the slowest rank's link, predicted from the seed
  // (0: not predicted): a time per step that no split of the batch changes.
  double predictedAllreduceSeconds_ = 0;
  double lastTransferSeconds_ = 0;  // the newest measured input transfer (0: none)
  double lastEmulatedSeconds_ = 0;  // the emulator's sleep after this step (0: none)
  double epochLossSum_ = 0;
  int64_t epochSamples_ = 0;
  double lastEpochLoss_ = 0;
  std::map<std::string, double> lastEvaluation_;

  // ---- elastic membership (elastic.h) ------------------------------------------------
  train::ElasticEnv elastic_;
  int64_t commitEvery_ = 10;  // steps between commits (re-derived at each commit)
  int64_t nextCommit_ = 0;
  Clock::time_point lastCommitTime_;
  int64_t lastCommitStep_ = 0;
  train::SampleLog sampleLog_;
  train::ProgressMark progressMark_;
  train::JobRecord jobRecord_;  // rank 0 of an elastic job
  /// A commit: the state file, then (elastic) the ranks agree on a re-form request and
  /// on the next commit step; leaves the process with kReformExitCode on a request.
  void commit(TrainSummary& summary);
  /// The elastic part of a commit whose state file is written (re-form request, next
  /// commit step); nothing without elastic membership.
  void agreeAtCommit(const TrainSummary& summary);
};

/// Seconds from `a` to `b` on the Trainer's clock.
inline double seconds(Trainer::Impl::Clock::time_point a, Trainer::Impl::Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace hddp
