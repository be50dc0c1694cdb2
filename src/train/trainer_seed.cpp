// The Trainer's seed before its first step (TrainerOptions::seedPlan): a timed forward
// of this rank's model, the seed rule of hddp/balance/seed.h over every rank, the
// memory caps given by TrainerOptions::maxLocalBatch (the allreduce's prediction is in
// trainer_compression.cpp).
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
#include "train/trainer_impl.h"

namespace hddp {

// Compute seconds per sample of the model on this rank, from forward passes of (up to)
// 8 samples in eval mode without gradients (nothing of the model's state changes): one
// warm-up, then the fastest of three (a pass slowed by another process is not the
// device's speed); backward is taken as twice a forward. Timed by
// TrainerOptions::measurementClock where one is given.
double Trainer::Impl::timeForward(const Dataset& data) {
  const std::function<double()> now =
      options_.measurementClock.now ? options_.measurementClock.now : [] {
        return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
      };
  const int64_t n = std::min<int64_t>(8, data.size());
  std::vector<Example> examples;
  for (int64_t i = 0; i < n; ++i) {
    SampleRng rng(sampleSeed(options_.seed, 0, i));
    examples.push_back(data.get(i, rng));
  }
  const at::Tensor input = collate(examples).input.to(device_);
  const bool training = model_->is_training();
  model_->eval();
  double seconds = 0.0;
  {
    at::NoGradGuard noGrad;
    std::optional<AutocastGuard> autocast;
    if (options_.amp != AmpMode::Off) {
      autocast.emplace(device_.type(), options_.amp == AmpMode::Bf16 ? at::kBFloat16 : at::kHalf);
    }
    c10::impl::VirtualGuardImpl guard(device_.type());
    seconds = std::numeric_limits<double>::max();
    for (int pass = 0; pass < 4; ++pass) {
      if (!device_.is_cpu()) {
        guard.synchronizeDevice(device_.index());
      }
      const double t0 = now();
      forward_(input);
      if (!device_.is_cpu()) {
        guard.synchronizeDevice(device_.index());
      }
      if (pass > 0) {
        seconds = std::min(seconds, now() - t0);
      }
    }
  }
  model_->train(training);
  return 3.0 * seconds / static_cast<double>(n);
}

// Every rank's cost before the first step (TrainerOptions::seedPlan): this rank's
// profile (link, input bytes, a timed forward, emulation), exchanged.
std::vector<RankCost> Trainer::Impl::seedCosts(const Dataset& data,
                                               const EmulationOptions& emulation) {
  SampleRng rng(sampleSeed(options_.seed, 0, 0));
  const double bytesPerSample = static_cast<double>(data.get(0, rng).input.nbytes());
  // The link first (a few copies), then the timed forward, as before the seed rule moved.
  RankProfile profile = profileOf(device_, bytesPerSample, /*measureLink=*/!device_.is_cpu());
  SeedMeasurement measured;
  measured.computeSecondsPerSample = timeForward(data);
  measured.pinnedSideStreamCopies = options_.loader.pinMemory;
  profile = seedProfile(profile, measured, emulation);
  const RankCost mine = costOf(profile);
  HDDP_LOG_INFO("balance", "rank ", comm_.rank(), " seed: ", mine.secondsPerSample * 1e3,
                " ms/sample (timed forward x3",
                emulation.slowdown != 1.0 ? " x emulated slowdown" : "", "), ", bytesPerSample,
                " B/sample over ", mine.linkBytesPerSecond / 1e9, " GB/s (", linkSource(profile),
                profile.external ? ", eGPU" : "", ")",
                mine.transferOverlapped ? ", copies overlap compute" : "");
  return exchangeSeedCosts(comm_, mine);
}

void Trainer::Impl::applyGivenMemoryCaps() {
  const auto& caps = options_.maxLocalBatch;
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
      const int64_t share = equalSplit(comm_.size(), options_.globalBatch).local[r];
      HDDP_CHECK_AS(ConfigError, share <= cap, "rank ", r, " can hold ", cap,
                    " samples but its equal share of the global batch ", options_.globalBatch,
                    " is ", share, ": turn balancing on (so the planner respects the cap) or ",
                    "lower the global batch");
    }
  }
}

}  // namespace hddp
