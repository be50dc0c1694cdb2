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
  parts_.each([&](TrainerPart& part) { part.beforeStep(info); });
  fault::at(fault::Point::Step, step_ + 1);  // HDDP_FAULT's step=N (hddp/core/fault.h)
  StepClock clock;
  clock.start = Clock::now();
  balance_->beginStep(step_, batch);  // the timer, an emulated card's marks, the memory
  forwardAndBackward(batch, clock);
  // Every rank learns whether some rank abandoned the step (read with the last bucket).
  // The results must be readable on the host first: on a CPU device the optimizer reads
  // them there, and the status is a host read. On NCCL this is where the host waits for
  // the slower ranks' gradients: a communication wait, left out of the compute time.
  const bool readStatus = recovery_ != nullptr;
  StepTimer& timer = balance_->timer();
  timer.beginWait();
  if (readStatus || device_.is_cpu()) {
    comm_.synchronize();
  }
  const bool abandoned = readStatus && ddp_->lastStepAbandoned();
  timer.endWait();
  if (abandoned) {
    repeatStep(batch, clock.start);  // the timer's open step is dropped
    return false;
  }
  parts_.each([&](TrainerPart& part) { part.afterBackward(info); });
  const bool stepped = optimizerStep(batch, clock);
  const double compute = measureAndReplan(batch.share.localBatch);
  const double loss = report(batch, info, clock, compute, stepped);
  const StepEnd end{info, loss, stepped};
  parts_.each([&](TrainerPart& part) { part.afterOptimizerStep(end, parts_.requests()); });
  // Agreed now when a part asks for it (one allreduce a step), else at the epoch's end.
  parts_.afterStep(comm_, step_, !options_.saveDir.empty());
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
      balance_->emulator().checkMemory(local);
      lastStep_.loss = loss_(output, batch.target);
    }
    balance_->emulator().endForward();  // a slower card's forward: nothing overlaps it
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
  balance_->timer().stop();  // on a device: an event after the optimizer's kernels, read later
  clock.end = Clock::now();
  timeline_.add("optimizer", clock.backwardEnd, clock.end, step_);
  return stepped;
}

// This step's memory (for the metrics, the peaks, the planner's memory caps) and this
// rank's compute seconds (time waiting for communication left out; an emulated slower
// card adds what it has not slept already), given to the planner, which may re-split the
// next steps. Returns the newest compute seconds (0: none yet).
double Trainer::Impl::measureAndReplan(int64_t localBatch) {
  lastStep_.memory = balance_->endStepMemory(localBatch);
  thisEpoch_.peakMemory = std::max(thisEpoch_.peakMemory, lastStep_.memory.peak());
  run_.peakMemory = std::max(run_.peakMemory, lastStep_.memory.peak());
  for (const auto& bucket : ddp_->lastStepBucketTimes()) {
    timeline_.add("allreduce", bucket.launched, bucket.completed, step_, Track::Communication,
                  bucket.bytes);
  }
  const train::Balancing::Measured measured = balance_->measureAndReplan(timeline_, step_);
  lastStep_.transferSeconds = measured.transferSeconds;
  lastStep_.emulatedSeconds = measured.emulatedSeconds;
  lastStep_.newPlan = measured.newPlan;
  if (measured.newPlan) {
    loader_->setPlan(currentPlan());
  }
  return measured.computeSeconds;
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
  r.maxSteps = options_.maxSteps;  // the progress counts to where maxSteps ends the run
  r.localBatch = local;
  r.globalBatch = batch.share.globalBatch;
  r.dataWaitSeconds = batch.waitSeconds;
  r.computeSeconds = compute;
  r.commWaitSeconds = ddp_->lastStepStats().waitSeconds;
  const auto& powerSgd = ddp_->powerSgdState();
  r.predictedAllreduceSeconds =
      compression_.predictedSeconds(/*compressing=*/!powerSgd || powerSgd->compressing());
  r.transferSeconds = lastStep_.transferSeconds;
  r.emulatedSeconds = lastStep_.emulatedSeconds;
  r.lossScale = scaler_->isEnabled() ? scaler_->currentScale() : 1.0;
  r.learningRate = learningRateOf(optimizer_, lastStep_.learningRateUnknown);
  r.stepped = stepped;
  r.plan = batch.share.plan.local;
  const BatchPlanner* planner = balance_->planner();
  if (lastStep_.newPlan) {
    r.newPlan = planner->plan().local;
  }
  r.planExchangeSeconds = planner ? planner->lastExchangeSeconds() : 0.0;
  r.memory = lastStep_.memory;
  r.memoryCap = balance_->memoryCap();
  r.optimizerStateBytes = optimizerStateBytes(optimizer_);
  reporter_.step(r);
  return r.loss;
}

}  // namespace hddp
