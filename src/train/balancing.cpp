// Balancing, the Trainer's part that sizes each rank's share (train/balancing.h): the
// seed before the first step (a timed forward, the seed rule of hddp/balance/seed.h over
// every rank), the memory caps given by TrainerOptions::maxLocalBatch, and each step's
// measurements for the planner.
#include "train/balancing.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

#include "hddp/balance/cost_model.h"
#include "hddp/balance/seed.h"
#include "hddp/core/autocast.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/train/timeline.h"

namespace hddp::train {

using Clock = std::chrono::steady_clock;

double timeForward(torch::nn::Module& model, const Trainer::ForwardFn& forward, const Dataset& data,
                   const TrainerOptions& options, c10::Device device) {
  const std::function<double()> now =
      options.measurementClock.now ? options.measurementClock.now : [] {
        return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
      };
  const int64_t n = std::min<int64_t>(8, data.size());
  std::vector<Example> examples;
  for (int64_t i = 0; i < n; ++i) {
    SampleRng rng(sampleSeed(options.seed, 0, i));
    examples.push_back(data.get(i, rng));
  }
  const at::Tensor input = collate(examples).input.to(device);
  const bool training = model.is_training();
  model.eval();
  double seconds = 0.0;
  {
    at::NoGradGuard noGrad;
    std::optional<AutocastGuard> autocast;
    if (options.amp != AmpMode::Off) {
      autocast.emplace(device.type(), options.amp == AmpMode::Bf16 ? at::kBFloat16 : at::kHalf);
    }
    c10::impl::VirtualGuardImpl guard(device.type());
    seconds = std::numeric_limits<double>::max();
    for (int pass = 0; pass < 4; ++pass) {
      if (!device.is_cpu()) {
        guard.synchronizeDevice(device.index());
      }
      const double t0 = now();
      forward(input);
      if (!device.is_cpu()) {
        guard.synchronizeDevice(device.index());
      }
      if (pass > 0) {
        seconds = std::min(seconds, now() - t0);
      }
    }
  }
  model.train(training);
  return 3.0 * seconds / static_cast<double>(n);
}

Balancing::Balancing(Communicator& comm, c10::Device device, const TrainerOptions& options,
                     const EmulationOptions& emulation)
    : comm_(comm), device_(device), globalBatch_(options.globalBatch), memory_(device, emulation) {
  Emulator::Clocks clocks;  // empty: the steady clock and the thread's time queued
  if (options.measurementClock.now) {
    // A clock of one's own has no time queued for a core.
    clocks = {options.measurementClock.now, [] { return -1.0; }};
  }
  emulator_ =
      std::make_unique<Emulator>(emulation, comm.rank(), options.measurementClock.sleep, clocks);
}

Balancing::~Balancing() { waitsHandle_.remove(); }

const std::vector<RankCost>& Balancing::measureSeed(torch::nn::Module& model,
                                                    const Trainer::ForwardFn& forward,
                                                    const Dataset& data,
                                                    const TrainerOptions& options) {
  const EmulationOptions& emulation = emulator_->options();
  SampleRng rng(sampleSeed(options.seed, 0, 0));
  const double bytesPerSample = static_cast<double>(data.get(0, rng).input.nbytes());
  // The link first (a few copies), then the timed forward, as before the seed rule moved.
  RankProfile profile = profileOf(device_, bytesPerSample, /*measureLink=*/!device_.is_cpu());
  SeedMeasurement measured;
  measured.computeSecondsPerSample = timeForward(model, forward, data, options, device_);
  measured.pinnedSideStreamCopies = options.loader.pinMemory;
  profile = seedProfile(profile, measured, emulation);
  const RankCost mine = costOf(profile);
  HDDP_LOG_INFO("balance", "rank ", comm_.rank(), " seed: ", mine.secondsPerSample * 1e3,
                " ms/sample (timed forward x3",
                emulation.slowdown != 1.0 ? " x emulated slowdown" : "", "), ", bytesPerSample,
                " B/sample over ", mine.linkBytesPerSecond / 1e9, " GB/s (", linkSource(profile),
                profile.external ? ", eGPU" : "", ")",
                mine.transferOverlapped ? ", copies overlap compute" : "");
  seed_ = exchangeSeedCosts(comm_, mine);
  return seed_;
}

void Balancing::start(const TrainerOptions& options) {
  if (options.balance) {
    planner_ =
        std::make_unique<BatchPlanner>(comm_, PlannerOptions(options.globalBatch, options.planner),
                                       options.seedPlan ? seed_ : std::vector<RankCost>{});
  }
  applyGivenMemoryCaps(options);
  timer_ = options.stepTimer ? options.stepTimer(device_) : makeStepTimer(device_);
  HDDP_CHECK_AS(ConfigError, timer_ != nullptr, "TrainerOptions::stepTimer returned no timer");
  // Every collective's wait in a step is waiting, not compute: SyncBatchNorm's in
  // forward and backward, a user's own, DDP's buckets.
  waits_ = std::make_unique<TimerWaits>(*timer_);
  waitsHandle_ = comm_.addWaitObserver(*waits_);
}

BatchPlan Balancing::plan(int64_t globalBatch) const {
  return planner_ ? planner_->plan() : equalSplit(comm_.size(), globalBatch);
}

void Balancing::applyGivenMemoryCaps(const TrainerOptions& options) {
  const auto& caps = options.maxLocalBatch;
  if (caps.empty()) {
    return;
  }
  HDDP_CHECK_AS(ConfigError, static_cast<int>(caps.size()) == comm_.size(),
                "TrainerOptions::maxLocalBatch has ", caps.size(), " entries for ", comm_.size(),
                " ranks: give one per rank (0 = no cap)");
  for (int r = 0; r < comm_.size(); ++r) {
    const int64_t cap = caps[static_cast<size_t>(r)];
    HDDP_CHECK_AS(ConfigError, cap >= 0, "TrainerOptions::maxLocalBatch for rank ", r, " is ", cap,
                  ": use a number of samples, or 0 for no cap");
    if (cap == 0) {
      continue;
    }
    if (planner_) {
      planner_->setMemoryCap(r, cap);
    } else {
      const int64_t share = equalSplit(comm_.size(), options.globalBatch).local[r];
      HDDP_CHECK_AS(ConfigError, share <= cap, "rank ", r, " can hold ", cap,
                    " samples but its equal share of the global batch ", options.globalBatch,
                    " is ", share, ": turn balancing on (so the planner respects the cap) or ",
                    "lower the global batch");
    }
  }
}

void Balancing::beginStep(int64_t step, const Batch& batch) {
  timer_->start(StepLabel{step, batch.share.localBatch, batch.bytes});
  emulator_->beginStep(step, batch.share.localBatch);  // an emulated slower card's marks
  timer_->copySpan(batch.copyStarted, batch.copied);
  memory_.beginStep();
}

MemoryReading Balancing::endStepMemory(int64_t localBatch) {
  MemoryReading reading = memory_.endStep(localBatch);
  if (planner_ && localBatch > 0) {
    planner_->recordMemory(reading.observation(localBatch));
  }
  return reading;
}

// This rank's compute seconds (time waiting for communication left out; an emulated
// slower card or link adds here what its marks in forward and before each bucket have
// not slept already, hddp/balance/emulation.h), given to the planner.
Balancing::Measured Balancing::measureAndReplan(Timeline& timeline, int64_t step) {
  // Collect, then record: the emulator gives each timing as the emulated card would
  // have (sleeping its extra time), else as measured.
  Measured out;
  for (const StepTiming& timing : timer_->collect()) {
    const auto e0 = Clock::now();
    const Emulator::Measured measured = emulator_->measure(timing);
    if (emulator_->active() && timing.label.samples > 0) {
      timeline.add("emulated delay", e0, Clock::now(), timing.label.step);
    }
    out.computeSeconds = measured.computeSeconds;
    out.transferSeconds = measured.measurement.transferSeconds;
    out.emulatedSeconds += measured.emulatedSeconds;
    if (planner_) {
      planner_->record(measured.measurement);
    }
  }
  if (planner_) {
    const auto p0 = Clock::now();
    out.newPlan = planner_->endStep();
    if (planner_->lastExchangeSeconds() > 0) {
      timeline.add("plan exchange", p0, Clock::now(), step, Track::Communication);
    }
  }
  return out;
}

int64_t Balancing::memoryCap() const {
  if (!planner_) {
    return -1;
  }
  const int64_t cap = planner_->memoryCaps()[static_cast<size_t>(comm_.rank())];
  return cap == std::numeric_limits<int64_t>::max() ? -1 : cap;
}

}  // namespace hddp::train
