// The Trainer's loop's own state (internal to the train layer): the fit() in progress,
// the epoch in progress (what a mid-epoch state file carries), and what the step just
// run left for its report and the next step.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <string>

#include "hddp/data/distributed_sampler.h"
#include "train/memory_meter.h"

namespace hddp::train {

using LoopClock = std::chrono::steady_clock;

/// This fit() (and what it reports in its summary).
struct RunState {
  LoopClock::time_point start;
  int64_t startStep = 0;
  bool stoppedEarly = false;              // maxSteps or the time budget ended it inside the epochs
  bool resumed = false;                   // it started from a state file
  bool restarted = false;                 // load() runs for a launcher's restart of this job
  bool budgetCarry = false;               // load() takes the saved budget (a launcher's restart)
  int64_t lastSaved = -1;                 // the step of the newest state file
  LoopClock::time_point lastSaveStart{};  // when that save began
  int64_t repeatedSteps = 0;              // abandoned (out of memory) and trained again
  int64_t samples = 0;                    // global samples trained by this fit()
  double peakMemory = 0;                  // MemoryReading::peak() over the run
  double lastTrainLoss = 0;               // of the last complete epoch
  std::map<std::string, double> lastEvaluation;
};

/// The epoch in progress (carried by a mid-epoch state file).
struct EpochState {
  int64_t steps = 0;
  double lossSum = 0;  // over all ranks (rank 0 carries it)
  int64_t samples = 0;
  bool midEpoch = false;  // a resume continues inside the epoch, at `sampler`
  DistributedSampler::State sampler;
  double peakMemory = 0;  // MemoryReading::peak() over the epoch
};

/// What the step just run left for its report and the next step.
struct LastStep {
  at::Tensor loss;                   // undefined without samples
  bool newPlan = false;              // the planner changed the plan at the step's end
  MemoryReading memory;              // valid after a step with samples
  double transferSeconds = 0;        // the newest measured input transfer (0: none)
  double emulatedSeconds = 0;        // the emulator's sleep after the step (0: none)
  bool learningRateUnknown = false;  // the optimizer's options have no get_lr()
};

}  // namespace hddp::train
