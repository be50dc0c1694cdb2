// Balancing, the Trainer's part that sizes each rank's share of the global batch
// (internal to the train layer): the step timer (the communicator's waits left out of
// compute), an emulated slower card (hddp/balance/emulation.h), the memory meter, the
// seed before the first step, and the planner that records each step's measurements and
// re-splits. A hand-written loop uses the public pieces it is made of (StepTimer,
// Emulator, BatchPlanner, PlanSampler: docs/quickstart.md).
#pragma once

#include <memory>
#include <vector>

#include "hddp/balance/cost_model.h"
#include "hddp/balance/emulation.h"
#include "hddp/balance/planner.h"
#include "hddp/comm/wait_observer.h"
#include "hddp/core/step_timer.h"
#include "hddp/train/trainer.h"
#include "train/memory_meter.h"

namespace hddp {
class Timeline;
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

/// Compute seconds per sample of `model` on `device` from timed forward passes of up to
/// 8 samples in eval mode without gradients (one warm-up, the fastest of three; backward
/// taken as twice a forward), under the run's autocast; by options.measurementClock
/// where one is given.
double timeForward(torch::nn::Module& model, const Trainer::ForwardFn& forward, const Dataset& data,
                   const TrainerOptions& options, c10::Device device);

class Balancing {
 public:
  /// The emulator and the memory meter; the timer and the planner come with start().
  Balancing(Communicator& comm, c10::Device device, const TrainerOptions& options,
            const EmulationOptions& emulation);
  ~Balancing();
  Balancing(const Balancing&) = delete;
  Balancing& operator=(const Balancing&) = delete;

  /// Every rank's cost before the first step (TrainerOptions::seedPlan, and what
  /// --compress auto prices): this rank's profile (link, input bytes, a timed forward,
  /// emulation), exchanged; kept (seed()).
  const std::vector<RankCost>& measureSeed(torch::nn::Module& model,
                                           const Trainer::ForwardFn& forward, const Dataset& data,
                                           const TrainerOptions& options);
  /// The seed's costs by rank (empty without a seed).
  const std::vector<RankCost>& seed() const { return seed_; }
  /// The planner (options.balance; from the seed where one was measured) with the given
  /// memory caps (TrainerOptions::maxLocalBatch), and the step timer registered for the
  /// communicator's waits.
  void start(const TrainerOptions& options);

  BatchPlanner* planner() { return planner_.get(); }
  const BatchPlanner* planner() const { return planner_.get(); }
  /// The planner's plan, or the equal split without balancing.
  BatchPlan plan(int64_t globalBatch) const;
  Emulator& emulator() { return *emulator_; }
  const Emulator& emulator() const { return *emulator_; }
  MemoryMeter& memory() { return memory_; }
  StepTimer& timer() { return *timer_; }

  /// A step's start: the timer, the emulator's marks, the input copy's span, the memory.
  void beginStep(int64_t step, const Batch& batch);
  /// After the optimizer's update: this step's memory, given to the planner's caps.
  MemoryReading endStepMemory(int64_t localBatch);

  /// What the timer has finished measuring, as the emulated card would have taken it.
  struct Measured {
    double computeSeconds = 0;   // the newest (0: none yet)
    double transferSeconds = 0;  // the newest measured input transfer (0: none)
    double emulatedSeconds = 0;  // the emulator's sleep (0: none)
    bool newPlan = false;        // the planner re-split
  };
  /// The steps the timer has finished (this one on the host clock, usually the previous
  /// one with device events), recorded by the planner, which may re-split (one exchange
  /// at its interval). Emulated delays and plan exchanges go on `timeline`.
  Measured measureAndReplan(Timeline& timeline, int64_t step);

  /// This rank's memory cap in samples (-1: none, or no planner).
  int64_t memoryCap() const;
  /// TrainerOptions::maxLocalBatch: the planner's caps, or without one a check that the
  /// equal split fits them.
  void applyGivenMemoryCaps(const TrainerOptions& options);

 private:
  Communicator& comm_;
  c10::Device device_;
  int64_t globalBatch_;
  std::unique_ptr<Emulator> emulator_;
  MemoryMeter memory_;
  std::vector<RankCost> seed_;
  std::unique_ptr<BatchPlanner> planner_;
  std::unique_ptr<StepTimer> timer_;
  std::unique_ptr<TimerWaits> waits_;  // the communicator's waits, on timer_
  RemovableHandle waitsHandle_;
};

}  // namespace train
}  // namespace hddp
