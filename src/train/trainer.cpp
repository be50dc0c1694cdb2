#include "hddp/train/trainer.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <optional>
#include <set>
#include <utility>

#include "hddp/balance/cost_model.h"
#include "hddp/balance/seed.h"
#include "hddp/comm/exchange.h"
#include "hddp/comm/link_emulation.h"
#include "hddp/core/autocast.h"
#include "hddp/core/env.h"
#include "hddp/core/error.h"
#include "hddp/core/fault.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/sync_batch_norm.h"
#include "hddp/topology/topology.h"
#include "hddp/train/state_file.h"
#include "hddp/train/tensorboard.h"
#include "train/model_device.h"
#include "train/options_agreement.h"
#include "train/trainer_checks.h"
#include "train/trainer_impl.h"

namespace hddp {

Trainer::Impl::Impl(Communicator& comm, std::shared_ptr<torch::nn::Module> model, ForwardFn forward,
                    LossFn loss, torch::optim::Optimizer& optimizer,
                    std::shared_ptr<const Dataset> train, TrainerOptions options)
    : emulatedLink_(train::emulatedLinkFor(comm, options)),
      comm_(emulatedLink_ ? *emulatedLink_ : comm),
      model_(std::move(model)),
      forward_(std::move(forward)),
      loss_(std::move(loss)),
      optimizer_(optimizer),
      given_(options),
      options_(std::move(options)),
      device_(train::modelDevice(model_.get(), comm)),
      elastic_(options_.launch ? *options_.launch : detectJob(processEnvironment())),
      timeline_(!options_.timelinePath.empty()),
      // Not finite is refused by checkOptions, agreed; until then, no budget.
      budget_(comm_, std::isfinite(options_.timeBudgetSeconds) ? options_.timeBudgetSeconds : 0,
              options_.budgetClock) {
  HDDP_CHECK_AS(ConfigError, model_ != nullptr && forward_ && loss_,
                "Trainer needs a model, a forward function and a loss function");
  const train::RankDeviceScope onDevice(device_);  // the seed's timed forward, the DDP
  // A rank's own problem with its options (its device, its data) fails every rank at once;
  // then every rank must have been given the options that shape the collectives alike.
  for (const auto& module : model_->modules(/*include_self=*/true)) {
    hasSyncBatchNorm_ = hasSyncBatchNorm_ || dynamic_cast<SyncBatchNormImpl*>(module.get());
  }
  ResolvedOptions resolved;
  agreeOutcome<ConfigError>(comm, "checking the Trainer's options", [&] {
    RankFacts facts;
    facts.device = device_;
    facts.elasticDir = elastic_.enabled() ? elastic_.dir() : std::string();
    facts.hasSyncBatchNorm = hasSyncBatchNorm_;
    if (given_.amp == AmpMode::Bf16) {
      facts.bf16Fallback = env::resolveBool("HDDP_BF16_FALLBACK", given_.bf16Fallback).value;
      if (facts.bf16Fallback) {
        const Bf16Support bf16 = bf16Support(device_);
        facts.bf16Native = bf16.native;
        facts.bf16Why = bf16.why;
      }
    }
    resolved = resolveOptions(given_, facts);
    train::checkOptions(resolved.options, train.get(), comm, device_);
  });
  options_ = std::move(resolved.options);
  for (const auto& note : resolved.notes) {
    if (note.warn) {
      HDDP_LOG_WARN("train", "rank ", comm.rank(), " ", note.text);
    } else if (note.everyRank) {
      HDDP_LOG_INFO("train", "rank ", comm.rank(), " ", note.text);
    } else {
      HDDP_LOG_SHARED("train", comm.rank(), note.text);
    }
  }
  train::checkOptionsAgree(comm, options_);
  if (elastic_.underAgent()) {
    // torchrun's agent starts new generations of ranks (a node left or joined, a rank
    // failed): with a save folder they commit and resume as in hddp-run's elastic job.
    if (!options_.saveDir.empty()) {
      elastic_.commitForAgent(options_.saveDir);
      if (elastic_.runId().empty() && comm.rank() == 0) {
        HDDP_LOG_WARN("train",
                      "torchrun runs this job without a job id (--rdzv-id): a "
                      "generation it starts after a node joins cannot tell this job's commits "
                      "in ",
                      options_.saveDir,
                      " from another job's, so it resumes them only "
                      "with --resume. Give --rdzv-id");
      }
    } else if (comm.rank() == 0) {
      HDDP_LOG_WARN("train", "torchrun's agent runs this job (id '", elastic_.runId(),
                    "') but no save folder is given: a generation it starts after a node "
                    "leaves or joins, or after a failure, trains from step 0. Give saveDir "
                    "(--save-dir) to commit and resume");
    }
  }
  // Elastic commits and a launcher's restarts decide exchanges too (fit()'s start, the
  // commits): every rank must see the same launcher.
  const uint8_t elastic = (elastic_.enabled() ? 1 : 0) | (elastic_.underAgent() ? 2 : 0);
  for (const uint8_t other : allgatherValue<uint8_t>(comm, elastic)) {
    HDDP_CHECK_AS(ConfigError, other == elastic,
                  "the ranks were not started alike: some run as an elastic job (hddp-run "
                  "--elastic, or torchrun's agent) and some do not; start every rank with the "
                  "same launcher and settings");
  }
  HDDP_LOG_INFO("train", "rank ", comm.rank(), " trains on ", device_.str(),
                comm.device() != device_ ? " (" + std::string(backendName(comm.backend())) +
                                               " communicates from " + comm.device().str() + ")"
                                         : std::string());
  train::checkOptimizerListsEachTensorOnce(optimizer_, *model_);
  const int rank = comm.rank();
  const EmulationOptions emulation =
      options_.emulation ? *options_.emulation : emulationFromEnv(rank, comm.size());
  // GradCompression::Auto: DDP starts with the plain allreduce and is switched before
  // its first step, once it has checked that the ranks' models agree and the seed has
  // timed them.
  const bool autoCompress = options_.ddp.compression == GradCompression::Auto;
  DdpOptions ddpOptions = options_.ddp;
  if (options_.zero > 0) {
    ddpOptions.allocateBucketsLazily = true;  // a rank keeps its own buckets only
  }
  if (autoCompress) {
    ddpOptions.compression = GradCompression::None;
  }
  Emulator::Clocks clocks;  // empty: the steady clock and the thread's time queued
  if (options_.measurementClock.now) {
    // A clock of one's own has no time queued for a core.
    clocks = {options_.measurementClock.now, [] { return -1.0; }};
  }
  emulator_ = std::make_unique<Emulator>(emulation, rank, options_.measurementClock.sleep, clocks);
  if (emulation.slowdown != 1.0) {
    // An emulated slower card sends each bucket when it would have computed it: its
    // stretched backward overlaps the allreduce as a real one does.
    ddpOptions.beforeBucketLaunch = [this,
                                     user = std::move(ddpOptions.beforeBucketLaunch)](int bucket) {
      emulator_->beforeBucketLaunch(bucket);
      if (user) {
        user(bucket);
      }
    };
  }
  ddp_ = std::make_unique<DistributedDataParallel>(model_, comm_, ddpOptions);
  const bool seeded = options_.balance && options_.seedPlan;
  std::vector<RankCost> seed;
  if (seeded || autoCompress) {
    seed = seedCosts(*train, emulation);
    seedCosts_ = seed;
  }
  if (autoCompress) {
    resolveCompression(seed, emulation);
    ddp_->setCompression(options_.ddp.compression, options_.ddp.powerSgd);
    compressionChosen_ = true;
  }
  compressionName_ = train::compressionName(options_.ddp);
  memory_ = train::MemoryMeter(device_, emulation);
  if (options_.zero > 0) {
    shardOptimizer();
  }
  if (seeded) {
    predictAllreduce(seed);
  }
  if (options_.balance) {
    planner_ = std::make_unique<BatchPlanner>(
        comm_, PlannerOptions(options_.globalBatch, options_.planner),
        seeded ? std::move(seed) : std::vector<RankCost>{});
  }
  applyGivenMemoryCaps();
  GradScalerOptions so = options_.scaler;
  so.enabled = options_.amp == AmpMode::Fp16;
  scaler_ = std::make_unique<GradScaler>(so, &comm_);
  const bool recover = options_.recoverFromOutOfMemory && !hasSyncBatchNorm_;
  if (recover || scaler_->isEnabled()) {
    rollback_ = std::make_unique<StepRollback>(*model_, device_);
  }
  if (recover) {
    recovery_ = std::make_unique<OutOfMemoryRecovery>(comm_, *ddp_, planner_.get(), rollback_.get(),
                                                      device_, options_.planner.minLocalBatch);
  }
  const LoaderOptions& lo = options_.loader;  // its device and seeds: resolveOptions'
  loader_ = std::make_unique<PrefetchLoader>(std::move(train), rank, lo);
  timer_ = options_.stepTimer ? options_.stepTimer(device_) : makeStepTimer(device_);
  HDDP_CHECK_AS(ConfigError, timer_ != nullptr, "TrainerOptions::stepTimer returned no timer");
  // Every collective's wait in a step is waiting, not compute: SyncBatchNorm's in
  // forward and backward, a user's own, DDP's buckets.
  timerWaits_ = std::make_unique<train::TimerWaits>(*timer_);
  timerWaitsHandle_ = comm_.addWaitObserver(*timerWaits_);
  HDDP_LOG_SHARED("train", rank, "rank ", rank, "/", comm.size(), " on ", device_.str(), ": ",
                  loader_->dataset().describe(), "; global batch ", options_.globalBatch, ", ",
                  options_.epochs, " epochs, amp ", ampModeName(options_.amp), ", ",
                  options_.balance ? "planner" : "equal split", ", ", lo.workers,
                  " loader workers, prefetch depth ", lo.depth, "; step compute timed by ",
                  timer_->describe());
}

Trainer::Impl::~Impl() {
  timerWaitsHandle_.remove();
  try {
    loader_->stop();
  } catch (...) {
  }
}

BatchPlan Trainer::Impl::currentPlan() const {
  return planner_ ? planner_->plan() : equalSplit(comm_.size(), options_.globalBatch);
}

TrainSummary Trainer::Impl::fit() {
  checkWhole();  // the same on every rank: no collective before it
  // Faults on purpose (HDDP_FAULT): a rank whose variable does not parse fails with the
  // others, not before their first collective.
  agreeOutcome<ConfigError>(comm_, "reading HDDP_FAULT", [&] {
    fault::arm(comm_.rank(), elastic_.restarts(), elastic_.slot());
  });
  // Disarmed however fit() ends: a rank's collective faults are kept for the process,
  // and a fit() that threw must not leave them to a later one's collectives.
  struct Disarm {
    ~Disarm() { fault::disarm(); }
  } disarmAtEnd;
  struct Fitting {  // addPart() refuses while the hooks run
    explicit Fitting(bool& on) : on_(on) { on_ = true; }
    ~Fitting() { on_ = false; }
    bool& on_;
  } fitting(fitting_);
  int64_t reached = elastic_.begin(comm_.rank(), options_.saveDir);
  int64_t agreedStart = 0;
  if (elastic_.enabled() || elastic_.underAgent()) {
    // Each folder holds the marks of its own ranks: the newest of all of them; and one
    // start time for the generation (unix milliseconds: the sample log's generation under
    // torchrun's agent).
    const double now =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    const auto newest = reduceValues(
        comm_, std::array<double, 2>{static_cast<double>(reached), std::floor(now * 1e3)},
        ReduceOp::Max);
    reached = static_cast<int64_t>(newest[0]);
    agreedStart = static_cast<int64_t>(newest[1]);
  }
  agreePartNames();  // before the resume, which loads their states
  resumeForFit();
  // The files each rank opens now (the sample log, the progress marks, the metrics file;
  // rank 0 TensorBoard's), agreed: a file one rank cannot write fails the run on every
  // rank at once, rather than leave the others in the next collective until its timeout.
  agreeOutcome<ConfigError>(comm_, "opening the output files at the start of fit()", [&] {
    elastic_.started(comm_.rank(), comm_.size(), step_, reached, run_.resumed, options_.saveDir,
                     agreedStart);
    reporter_ = train::Reporter(
        options_.metricsPath, comm_.rank(),
        /*append=*/run_.resumed || elastic_.restarts() > 0, options_.progress != ProgressMode::Off,
        options_.progress == ProgressMode::Auto && ::isatty(STDERR_FILENO), options_.logEvery);
    reporter_.config(runConfig());
    reporter_.startTensorBoard(options_.tensorboard, step_ + 1);
  });  // also the run's common time zero
  timeline_.setOrigin(Clock::now());
  elastic_.startCommits(step_);
  startParts();  // the program's parts: agreed, then their onFitStart

  TrainSummary summary;
  run_.start = Clock::now();
  budget_.startClock();  // the time budget's own clock (TrainerOptions::budgetClock)
  run_.startStep = step_;
  run_.stoppedEarly = false;
  int64_t samples = 0;
  EpochEnd end = EpochEnd::Complete;
  while (epoch_ < options_.epochs && end == EpochEnd::Complete) {
    end = runEpoch(summary, samples);
  }
  if (end == EpochEnd::Stopped) {
    // maxSteps or the time budget ended the run inside an epoch: evaluate what was
    // trained.
    const auto evaluation = evaluate();
    if (!evaluation.empty()) {
      const std::string why = options_.maxSteps > 0 && step_ >= options_.maxSteps ? "maxSteps"
                              : budget_.reached(step_) ? "the time budget"
                                                       : "a part (" + partsStopWhy_ + ")";
      reporter_.evaluationAtStop(epoch_, step_, evaluation, currentPlan().describe(), why);
    }
    if (!options_.saveDir.empty() && run_.lastSaved != step_) {
      summary.lastStateFile = save();
    }
  }
  summary.steps = step_ - run_.startStep;
  summary.totalSteps = step_;
  summary.seconds = seconds(run_.start, Clock::now());
  summary.samplesPerSecond = summary.seconds > 0 ? samples / summary.seconds : 0.0;
  summary.lastTrainLoss = run_.lastTrainLoss;
  summary.repeatedSteps = run_.repeatedSteps;
  summary.peakMemoryBytes = run_.peakMemory;
  summary.lastEvaluation = run_.lastEvaluation;
  if (timeline_.enabled()) {
    timeline_.write(comm_, options_.timelinePath);
  }
  reporter_.summary(summary, run_.lastEvaluation);
  eachPart([&](TrainerPart& part) { part.onFitEnd(summary); });
  agreeParts();
  return summary;  // disarmAtEnd: a later save() of this Trainer meets no fault left over
}

Trainer::Trainer(Communicator& communicator, std::shared_ptr<torch::nn::Module> model,
                 ForwardFn forward, LossFn loss, torch::optim::Optimizer& optimizer,
                 std::shared_ptr<const Dataset> train, TrainerOptions options)
    : impl_(std::make_unique<Impl>(communicator, std::move(model), std::move(forward),
                                   std::move(loss), optimizer, std::move(train),
                                   std::move(options))) {}
Trainer::~Trainer() = default;
void Trainer::setSchedule(ScheduleFn schedule) { impl_->schedule_ = std::move(schedule); }
void Trainer::setEvaluation(EvalFn evaluation) { impl_->evaluation_ = std::move(evaluation); }
void Trainer::addPart(std::shared_ptr<TrainerPart> part) { impl_->addPart(std::move(part)); }
TrainSummary Trainer::fit() {
  const train::RankDeviceScope onDevice(impl_->device_);
  return impl_->fit();
}
std::string Trainer::save() {
  const train::RankDeviceScope onDevice(impl_->device_);
  return impl_->save();
}
void Trainer::load(const std::string& fileOrDirectory) {
  const train::RankDeviceScope onDevice(impl_->device_);
  impl_->load(fileOrDirectory);
}
int64_t Trainer::step() const { return impl_->step_; }
int64_t Trainer::epoch() const { return impl_->epoch_; }
DistributedDataParallel& Trainer::ddp() { return *impl_->ddp_; }

c10::Device Trainer::device() const { return impl_->device_; }
BatchPlanner* Trainer::planner() { return impl_->planner_.get(); }

AmpMode Trainer::ampMode() const { return impl_->options_.amp; }

bool Trainer::stoppedEarly() const { return impl_->run_.stoppedEarly; }
BatchPlan Trainer::plan() const { return impl_->currentPlan(); }
GradScaler& Trainer::scaler() { return *impl_->scaler_; }
PrefetchLoader& Trainer::loader() { return *impl_->loader_; }
const TrainerOptions& Trainer::options() const { return impl_->given_; }
const TrainerOptions& Trainer::resolvedOptions() const { return impl_->options_; }

}  // namespace hddp
