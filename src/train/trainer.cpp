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
      // Not finite is refused by checkOptions, agreed; until then, no budget.
      budget_(comm_, std::isfinite(options_.timeBudgetSeconds) ? options_.timeBudgetSeconds : 0,
              options_.budgetClock),
      timeline_(!options_.timelinePath.empty()) {
  HDDP_CHECK_AS(ConfigError, model_ != nullptr && forward_ && loss_,
                "Trainer needs a model, a forward function and a loss function");
  const train::RankDeviceScope onDevice(device_);  // the seed's timed forward, the DDP
  resolveAndAgreeOptions(comm, train.get());
  const int rank = comm.rank();
  HDDP_LOG_INFO("train", "rank ", rank, " trains on ", device_.str(),
                comm.device() != device_ ? " (" + std::string(backendName(comm.backend())) +
                                               " communicates from " + comm.device().str() + ")"
                                         : std::string());
  train::checkOptimizerListsEachTensorOnce(optimizer_, *model_);
  buildDdpAndBalancing(*train);
  GradScalerOptions so = options_.scaler;
  so.enabled = options_.amp == AmpMode::Fp16;
  scaler_ = std::make_unique<GradScaler>(so, &comm_);
  const bool recover = options_.recoverFromOutOfMemory && !hasSyncBatchNorm_;
  if (recover || scaler_->isEnabled()) {
    rollback_ = std::make_unique<StepRollback>(*model_, device_);
  }
  if (recover) {
    recovery_ =
        std::make_unique<OutOfMemoryRecovery>(comm_, *ddp_, balance_->planner(), rollback_.get(),
                                              device_, options_.planner.minLocalBatch);
  }
  const LoaderOptions& lo = options_.loader;  // its device and seeds: resolveOptions'
  loader_ = std::make_unique<PrefetchLoader>(std::move(train), rank, lo);
  HDDP_LOG_SHARED("train", rank, "rank ", rank, "/", comm.size(), " on ", device_.str(), ": ",
                  loader_->dataset().describe(), "; global batch ", options_.globalBatch, ", ",
                  options_.epochs, " epochs, amp ", ampModeName(options_.amp), ", ",
                  options_.balance ? "planner" : "equal split", ", ", lo.workers,
                  " loader workers, prefetch depth ", lo.depth, "; step compute timed by ",
                  balance_->timer().describe());
}

Trainer::Impl::~Impl() {
  try {
    loader_->stop();
  } catch (...) {
  }
}

TrainSummary Trainer::Impl::fit() {
  checkWhole();  // the same on every rank: no collective before it
  // Disarmed however fit() ends: a rank's collective faults are kept for the process,
  // and a fit() that threw must not leave them to a later one's collectives.
  struct Disarm {
    ~Disarm() { fault::disarm(); }
  } disarmAtEnd;
  const train::PartList::Fitting fitting(parts_);  // addPart() refuses while hooks run
  startFit();
  TrainSummary summary;
  run_.start = Clock::now();
  budget_.startClock();  // the time budget's own clock (TrainerOptions::budgetClock)
  run_.startStep = step_;
  run_.stoppedEarly = false;
  run_.samples = 0;
  EpochEnd end = EpochEnd::Complete;
  while (epoch_ < options_.epochs && end == EpochEnd::Complete) {
    end = runEpoch(summary);
  }
  if (end == EpochEnd::Stopped) {
    endInsideEpoch(summary);
  }
  return finishFit(std::move(summary));  // disarmAtEnd: a later save() meets no fault
}

void Trainer::Impl::startFit() {
  // Faults on purpose (HDDP_FAULT): a rank whose variable does not parse fails with the
  // others, not before their first collective.
  agreeOutcome<ConfigError>(comm_, "reading HDDP_FAULT", [&] {
    fault::arm(comm_.rank(), elastic_.restarts(), elastic_.slot());
  });
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
  parts_.agreeNames(comm_);  // before the resume, which loads their states
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
  // The program's parts: agreed, then their onFitStart.
  parts_.start(comm_, FitStart{step_, epoch_, run_.resumed}, !options_.saveDir.empty());
}

// maxSteps, the time budget or a part ended the run inside an epoch: evaluate what was
// trained, and save it.
void Trainer::Impl::endInsideEpoch(TrainSummary& summary) {
  const auto evaluation = evaluate();
  if (!evaluation.empty()) {
    const std::string why = options_.maxSteps > 0 && step_ >= options_.maxSteps ? "maxSteps"
                            : budget_.reached(step_)                            ? "the time budget"
                                                     : "a part (" + parts_.stopWhy() + ")";
    reporter_.evaluationAtStop(epoch_, step_, evaluation, currentPlan().describe(), why);
  }
  if (!options_.saveDir.empty() && run_.lastSaved != step_) {
    summary.lastStateFile = save();
  }
}

TrainSummary Trainer::Impl::finishFit(TrainSummary summary) {
  summary.steps = step_ - run_.startStep;
  summary.totalSteps = step_;
  summary.seconds = seconds(run_.start, Clock::now());
  summary.samplesPerSecond =
      summary.seconds > 0 ? static_cast<double>(run_.samples) / summary.seconds : 0.0;
  summary.lastTrainLoss = run_.lastTrainLoss;
  summary.repeatedSteps = run_.repeatedSteps;
  summary.peakMemoryBytes = run_.peakMemory;
  summary.lastEvaluation = run_.lastEvaluation;
  if (timeline_.enabled()) {
    timeline_.write(comm_, options_.timelinePath);
  }
  reporter_.summary(summary, run_.lastEvaluation);
  parts_.each([&](TrainerPart& part) { part.onFitEnd(summary); });
  parts_.agree(comm_, step_, !options_.saveDir.empty());
  return summary;
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
void Trainer::addPart(std::shared_ptr<TrainerPart> part) { impl_->parts_.add(std::move(part)); }
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
BatchPlanner* Trainer::planner() { return impl_->balance_->planner(); }

AmpMode Trainer::ampMode() const { return impl_->options_.amp; }

bool Trainer::stoppedEarly() const { return impl_->run_.stoppedEarly; }
BatchPlan Trainer::plan() const { return impl_->currentPlan(); }
GradScaler& Trainer::scaler() { return *impl_->scaler_; }
PrefetchLoader& Trainer::loader() { return *impl_->loader_; }
const TrainerOptions& Trainer::options() const { return impl_->given_; }
const TrainerOptions& Trainer::resolvedOptions() const { return impl_->options_; }

}  // namespace hddp
