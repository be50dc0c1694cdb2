// One training step, in phases: forward and backward (with the out-of-memory catch),
// optimizer step, measurement and re-planning, report.
#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <optional>

#include "hddp/core/autocast.h"
#include "hddp/core/error.h"
#include "hddp/core/fault.h"
#include "hddp/core/logging.h"
#include "hddp/train/out_of_memory.h"
#include "hddp/train/step_rollback.h"
#include "train/trainer_impl.h"

namespace hddp {
namespace {

// The first parameter group's learning rate, from its options' get_lr() (every LibTorch
// optimizer's, and a custom one's that overrides it); -1 where get_lr() throws (the
// options of a custom optimizer that does not). `unknown` remembers that, so such an
// optimizer costs one exception per run, not one per step.
double learningRateOf(torch::optim::Optimizer& optimizer, bool& unknown) {
  if (unknown || optimizer.param_groups().empty()) {
    return -1;
  }
  try {
    return optimizer.param_groups().front().options().get_lr();
  } catch (const c10::Error&) {
    unknown = true;
    return -1;
  }
}

}  // namespace

// False when the step was abandoned (some rank ran out of memory): nothing was
// applied, and the loader serves the same samples again under the new split.
bool Trainer::Impl::runStep(const Batch& batch) {
  const StepInfo info{step_, epoch_, batch.stepInEpoch,
                      // this batch, the ones before it, and those still to come
                      batch.stepInEpoch + 1 + loader_->stepsLeftInEpoch(), batch.share.localBatch,
                      batch.share.globalBatch, plannedSteps()};
  if (schedule_) {
    schedule_(info, optimizer_);
  }
  eachPart([&](TrainerPart& part) { part.beforeStep(info); });
  fault::at(fault::Point::Step, step_ + 1);  // HDDP_FAULT's step=N (hddp/core/fault.h)
  StepClock clock;
  clock.start = Clock::now();
  timer_->start(StepLabel{step_, batch.share.localBatch, batch.bytes});
  emulator_->beginStep(step_, batch.share.localBatch);  // an emulated slower card's marks
  timer_->copySpan(batch.copyStarted, batch.copied);
  memory_.beginStep();
  forwardAndBackward(batch, clock);
  // Every rank learns whether some rank abandoned the step (read with the last bucket).
  // The results must be readable on the host first: on a CPU device the optimizer reads
  // them there, and the status is a host read. On NCCL this is where the host waits for
  // the slower ranks' gradients: a communication wait, left out of the compute time.
  const bool readStatus = recovery_ != nullptr;
  timer_->beginWait();
  if (readStatus || device_.is_cpu()) {
    comm_.synchronize();
  }
  const bool abandoned = readStatus && ddp_->lastStepAbandoned();
  timer_->endWait();
  if (abandoned) {
    repeatStep(batch, clock.start);  // the timer's open step is dropped
    return false;
  }
  eachPart([&](TrainerPart& part) { part.afterBackward(info); });
  const bool stepped = optimizerStep(batch, clock);
  measureMemory(batch.share.localBatch);
  const double compute = measureAndReplan();
  const double loss = report(batch, info, clock, compute, stepped);
  const StepEnd end{info, loss, stepped};
  eachPart([&](TrainerPart& part) { part.afterOptimizerStep(end, heldRequests_); });
  // Agreed now when a part asks for it (one allreduce a step), else at the epoch's end.
  partsSave_ = partsEachStep_ && agreeParts();
  return true;
}

// Forward and the scaled backward (the allreduce overlaps it). With out-of-memory
// recovery, a rank that runs out of memory gives the step up (OutOfMemoryRecovery::run).
void Trainer::Impl::forwardAndBackward(const Batch& batch, StepClock& clock) {
  const int64_t local = batch.share.localBatch;
  ddp_->setBatch(local, batch.share.globalBatch);
  if (sharded_) {
    sharded_->zeroGrad();  // the optimizer holds this rank's shard only
  } else {
    optimizer_.zero_grad();
  }
  clock.forwardEnd = clock.start;
  if (!rollback_ && scaler_->isEnabled()) {
    // A GradScaler enabled by a state file's (an fp16 run resumed): its skipped steps
    // put the buffers and generators back too.
    rollback_ = std::make_unique<StepRollback>(*model_, device_);
  }
  if (rollback_) {
    // What the forward changes before the step is known to stand (BatchNorm's statistics,
    // the generators): an abandoned step (repeatStep) and a step the GradScaler skips
    // (optimizerStep) put them back. Every step captures, one without samples too, so a
    // restore never brings back an older step's.
    rollback_->capture();
  }
  if (local == 0) {
    ddp_->finalize();  // no samples this step: contribute zeros, receive the others'
    return;
  }
  const auto work = [&] {
    {
      std::optional<AutocastGuard> autocast;
      if (options_.amp != AmpMode::Off) {
        autocast.emplace(device_.type(), options_.amp == AmpMode::Bf16 ? at::kBFloat16 : at::kHalf);
      }
      at::Tensor output = forward_(batch.input);
      emulator_->checkMemory(local);
      lastStep_.loss = loss_(output, batch.target);
    }
    emulator_->endForward();  // a slower card's forward: nothing overlaps it
    clock.forwardEnd = Clock::now();
    timeline_.add("forward", clock.start, clock.forwardEnd, step_, Track::Training, local);
    scaler_->scale(lastStep_.loss).backward();
  };
  if (!recovery_) {
    work();  // (SyncBatchNorm's collectives in forward cannot be matched: no recovery)
  } else if (!recovery_->run(work)) {
    lastStep_.loss = at::Tensor();
  }
}

// Some rank ran out of memory in this step (every rank gets here, after the step's
// collectives): the recovery undoes what the step changed, learns the failing ranks'
// memory caps and re-plans; the loader is rewound so the same global batch is served
// again under the new split. Nothing was applied (no optimizer step), so no sample is
// lost or counted twice.
void Trainer::Impl::repeatStep(const Batch& batch, Clock::time_point t0) {
  const auto recovery = recovery_->afterBackward(batch.share.localBatch, step_ + 1);
  HDDP_INTERNAL_ASSERT(recovery.has_value(), "the step was abandoned, but not on a second look");
  ++run_.repeatedSteps;
  reporter_.outOfMemory(*recovery, epoch_, step_ + 1);
  timeline_.add("out of memory, step repeated", t0, Clock::now(), step_);
  DistributedSampler::State state = loader_->state();
  state.position -= batch.share.globalBatch;
  HDDP_INTERNAL_ASSERT(state.position >= 0, "rewinding the sampler before the epoch start");
  loader_->resume(state, recovery->after);
}

// Unscale, clip, step (skipped on every rank on an fp16 overflow), update the scale.
bool Trainer::Impl::optimizerStep(const Batch& batch, StepClock& clock) {
  clock.backwardEnd = Clock::now();
  timeline_.add("backward", clock.forwardEnd, clock.backwardEnd, step_, Track::Training,
                batch.share.localBatch);
  if (options_.clipGradNorm > 0) {
    scaler_->unscale(optimizer_);
    if (sharded_) {
      sharded_->clipGradNorm(options_.clipGradNorm);  // the norm over every shard
    } else {
      // Each tensor once: a tied weight's norm counts once, as in PyTorch.
      torch::nn::utils::clip_grad_norm_(uniqueParameters(*model_), options_.clipGradNorm);
    }
  }
  // The found-inf is agreed across ranks before any shard steps, so every rank skips
  // together and no gather is owed.
  const bool stepped = scaler_->step(optimizer_);
  if (stepped && sharded_) {
    sharded_->gatherParameters();
  }
  if (!stepped && rollback_) {
    // A skipped step leaves no trace in BatchNorm's statistics or the generators (its
    // batch stays spent, as in single-device training with a GradScaler; PowerSGD's
    // memories were left as they were at decompression). Every rank skips together, and
    // the restore is local, so SyncBatchNorm's equal statistics stay equal.
    rollback_->restore();
    ddp_->putBackStepBuffers();  // and their weight in the next sync
  }
  scaler_->update();
  timer_->stop();  // on a device: an event after the optimizer's kernels, read later
  clock.end = Clock::now();
  timeline_.add("optimizer", clock.backwardEnd, clock.end, step_);
  return stepped;
}

// This step's memory: for the metrics, the peaks, and the planner's memory caps.
void Trainer::Impl::measureMemory(int64_t local) {
  lastStep_.memory = memory_.endStep(local);
  thisEpoch_.peakMemory = std::max(thisEpoch_.peakMemory, lastStep_.memory.peak());
  run_.peakMemory = std::max(run_.peakMemory, lastStep_.memory.peak());
  if (planner_ && local > 0) {
    planner_->recordMemory(lastStep_.memory.observation(local));
  }
}

// This rank's compute seconds (time waiting for communication left out; an emulated
// slower card or link adds here what its marks in forward and before each bucket have
// not slept already, hddp/balance/emulation.h), given to the planner, which may re-split
// the next steps. The step timer hands over the steps it has finished measuring: this
// one on the host clock, usually the previous one with device events. Returns the
// newest compute seconds (0: none yet).
double Trainer::Impl::measureAndReplan() {
  for (const auto& bucket : ddp_->lastStepBucketTimes()) {
    timeline_.add("allreduce", bucket.launched, bucket.completed, step_, Track::Communication,
                  bucket.bytes);
  }
  // Collect, then record: the emulator gives each timing as the emulated card would
  // have (sleeping its extra time), else as measured.
  double compute = 0.0;
  double transfer = 0.0;
  double emulated = 0.0;
  for (const StepTiming& timing : timer_->collect()) {
    const auto e0 = Clock::now();
    const Emulator::Measured measured = emulator_->measure(timing);
    if (emulator_->active() && timing.label.samples > 0) {
      timeline_.add("emulated delay", e0, Clock::now(), timing.label.step);
    }
    compute = measured.computeSeconds;
    transfer = measured.measurement.transferSeconds;
    emulated += measured.emulatedSeconds;
    if (planner_) {
      planner_->record(measured.measurement);
    }
  }
  lastStep_.transferSeconds = transfer;
  lastStep_.emulatedSeconds = emulated;
  lastStep_.newPlan = false;
  if (planner_) {
    const auto p0 = Clock::now();
    lastStep_.newPlan = planner_->endStep();
    if (planner_->lastExchangeSeconds() > 0) {
      timeline_.add("plan exchange", p0, Clock::now(), step_, Track::Communication);
    }
    if (lastStep_.newPlan) {
      loader_->setPlan(planner_->plan());
    }
  }
  return compute;
}

double Trainer::Impl::report(const Batch& batch, const StepInfo& info, const StepClock& clock,
                             double compute, bool stepped) {
  const int64_t local = batch.share.localBatch;
  train::StepReport r;
  r.loss = local > 0 ? lastStep_.loss.detach().to(at::kDouble).item<double>() : 0.0;
  // After the loss read (on a device: the step's end on the host) and the emulator's
  // sleep.
  r.stepSeconds = seconds(clock.start, Clock::now()) + batch.waitSeconds;
  thisEpoch_.lossSum += r.loss * static_cast<double>(local);
  thisEpoch_.samples += local;
  ++step_;
  r.epoch = epoch_;
  r.epochs = options_.epochs;
  r.step = step_;
  r.stepInEpoch = batch.stepInEpoch;
  r.stepsPerEpoch = info.stepsPerEpoch;
  r.localBatch = local;
  r.globalBatch = batch.share.globalBatch;
  r.dataWaitSeconds = batch.waitSeconds;
  r.computeSeconds = compute;
  r.commWaitSeconds = ddp_->lastStepStats().waitSeconds;
  const auto& powerSgd = ddp_->powerSgdState();
  r.predictedAllreduceSeconds = powerSgd && !powerSgd->compressing()
                                    ? predictedPlainAllreduceSeconds_
                                    : predictedAllreduceSeconds_;
  r.transferSeconds = lastStep_.transferSeconds;
  r.emulatedSeconds = lastStep_.emulatedSeconds;
  r.lossScale = scaler_->isEnabled() ? scaler_->currentScale() : 1.0;
  r.learningRate = learningRateOf(optimizer_, learningRateUnknown_);
  r.stepped = stepped;
  r.plan = batch.share.plan.local;
  if (lastStep_.newPlan) {
    r.newPlan = planner_->plan().local;
  }
  r.planExchangeSeconds = planner_ ? planner_->lastExchangeSeconds() : 0.0;
  r.memory = lastStep_.memory;
  if (planner_) {
    const int64_t cap = planner_->memoryCaps()[static_cast<size_t>(comm_.rank())];
    r.memoryCap = cap == std::numeric_limits<int64_t>::max() ? -1 : cap;
  }
  r.optimizerStateBytes = optimizerStateBytes(optimizer_);
  reporter_.step(r);
  return r.loss;
}

}  // namespace hddp
