// The Trainer's epochs and run between steps (internal to the train layer): one epoch's
// loop of steps and its end (evaluation, commits, the state file), how many steps are
// planned, the epoch record, and the configuration a metrics file starts with.
#include <torch/torch.h>

#include <algorithm>
#include <array>

#include "hddp/amp/amp_mode.h"
#include "hddp/comm/exchange.h"
#include "hddp/version.h"
#include "train/trainer_impl.h"

namespace hddp {

// The configuration a metrics file starts with (hddp-plot's title).
nlohmann::json Trainer::Impl::runConfig() const {
  const EmulationOptions& e = balance_->emulator().options();
  nlohmann::json c{{"world_size", comm_.size()},
                   {"device", device_.str()},
                   {"backend", backendName(comm_.backend())},
                   {"global_batch", options_.globalBatch},
                   {"epochs", options_.epochs},
                   {"amp", ampModeName(options_.amp)},
                   {"balance", balance_->planner() != nullptr},
                   {"compression", compression_.name()},
                   {"zero", options_.zero},
                   {"shard_by", options_.zero > 0 ? describeShardBy(options_.shardBy) : "-"},
                   {"hddp", version()}};
  if (e.active()) {
    c["emulation"] = {{"slowdown", e.slowdown},
                      {"link_GBps", e.linkBytesPerSecond / 1e9},
                      {"memory_cap_samples", e.memoryCapSamples},
                      {"memory_total_bytes", e.memoryTotalBytes}};
  }
  return c;
}

int64_t Trainer::Impl::plannedSteps() const {
  const int64_t n = loader_->dataset().size();
  const int64_t g = options_.globalBatch;
  const int64_t perEpoch = options_.loader.sampler.dropLast ? n / g : (n + g - 1) / g;
  int64_t total = perEpoch * options_.epochs;
  if (options_.maxSteps > 0) {
    total = std::min(total, options_.maxSteps);
  }
  return budget_.capSteps(total);
}

std::map<std::string, double> Trainer::Impl::evaluate() {
  if (!evaluation_) {
    return {};
  }
  const auto e0 = Clock::now();
  const double b0 = budget_.now();
  auto evaluation = evaluation_(epoch_);
  budget_.leaveOut(budget_.now() - b0);
  timeline_.add("evaluation", e0, Clock::now(), step_);
  model_->train();
  if (!evaluation.empty()) {
    run_.lastEvaluation = evaluation;
  }
  return evaluation;
}

void Trainer::Impl::endEpoch(Clock::time_point epochStart, int64_t epochSteps,
                             TrainSummary& summary) {
  // The epoch's mean training loss over every rank's samples.
  const auto sums = reduceValues(
      comm_, std::array<double, 2>{thisEpoch_.lossSum, static_cast<double>(thisEpoch_.samples)});
  train::EpochReport r;
  r.samples = sums[1];
  run_.lastTrainLoss = r.samples > 0 ? sums[0] / r.samples : 0.0;
  r.seconds = seconds(epochStart, Clock::now());
  r.evaluation = evaluate();
  // A save asked now is made anyway (the epoch's state file, with a save folder).
  const EpochSummary ended{epoch_, epochSteps, step_, run_.lastTrainLoss, r.evaluation};
  parts_.each([&](TrainerPart& part) { part.onEpochEnd(ended, parts_.requests()); });
  parts_.agree(comm_, step_, !options_.saveDir.empty());
  ++summary.epochsCompleted;
  r.epoch = epoch_;
  r.epochs = options_.epochs;
  r.steps = epochSteps;
  r.step = step_;
  r.trainLoss = run_.lastTrainLoss;
  const BatchPlan plan = currentPlan();
  r.plan = plan.local;
  r.planText = plan.describe();
  r.peakMemoryBytes = thisEpoch_.peakMemory;
  thisEpoch_.peakMemory = 0;
  reporter_.epoch(r);
}

bool Trainer::Impl::runEnds() const {
  return (options_.maxSteps > 0 && step_ >= options_.maxSteps) || budget_.reached(step_) ||
         parts_.stopAsked();
}

Trainer::Impl::EpochEnd Trainer::Impl::runEpoch(TrainSummary& summary) {
  model_->train();
  if (thisEpoch_.midEpoch) {
    // The epoch's sums and steps so far came with the state (load()).
    loader_->resume(thisEpoch_.sampler, currentPlan());
    thisEpoch_.midEpoch = false;
  } else {
    loader_->startEpoch(epoch_, currentPlan());
    thisEpoch_.lossSum = 0;
    thisEpoch_.samples = 0;
    thisEpoch_.steps = 0;
  }
  const auto epochStart = Clock::now();
  bool commitAtEpochEnd = false;  // a commit due at the epoch's last step
  bool stopAtEpochEnd = false;    // the run's end falls on the epoch's last step
  for (;;) {
    if (runEnds()) {
      if (thisEpoch_.steps > 0 && loader_->stepsLeftInEpoch() == 0) {
        // The epoch is complete: end it (evaluation, its state) rather than save an
        // empty remainder that a resume would report and evaluate again.
        stopAtEpochEnd = true;
        break;
      }
      run_.stoppedEarly = true;
      thisEpoch_.sampler = loader_->state();
      thisEpoch_.midEpoch = true;  // a resume continues inside this epoch
      return EpochEnd::Stopped;
    }
    const auto waitStart = Clock::now();
    auto batch = loader_->next();
    if (!batch) {
      break;
    }
    timeline_.add("data wait", waitStart, Clock::now(), step_);
    if (!runStep(*batch)) {
      continue;  // a rank ran out of memory: the step is repeated under a new split
    }
    run_.samples += batch->share.globalBatch;
    ++thisEpoch_.steps;
    elastic_.stepDone(step_, step_ == run_.startStep + 1, comm_.rank(), batch->share.indices);
    budget_.afterStep(step_, loader_->stepsLeftInEpoch() == 0);  // collective every 10
    if (parts_.saveAfterStep() ||
        (options_.saveEvery > 0 ? step_ % options_.saveEvery == 0 : elastic_.commitDue(step_))) {
      if (loader_->stepsLeftInEpoch() == 0) {
        commitAtEpochEnd = true;  // saved once, as the epoch's end, below
      } else {
        commit(summary);
      }
    }
  }
  if (stopAtEpochEnd) {
    run_.stoppedEarly = epoch_ + 1 < options_.epochs;  // the evaluation knows it is the last
  }
  endEpoch(epochStart, thisEpoch_.steps, summary);
  ++epoch_;
  if (!options_.saveDir.empty()) {
    summary.lastStateFile = save();
    run_.lastSaved = step_;
  }
  if (commitAtEpochEnd) {
    elastic_.committed(comm_, step_, summary.lastStateFile, run_.lastSaveStart);
  }
  if (parts_.stopAsked() && !stopAtEpochEnd) {  // a part asked at the epoch's end
    run_.stoppedEarly = epoch_ < options_.epochs;
    stopAtEpochEnd = true;
  }
  return stopAtEpochEnd ? EpochEnd::StopsTheRun : EpochEnd::Complete;
}

}  // namespace hddp
