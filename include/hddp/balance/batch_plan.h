// Cost model and the exact integer split of a global batch over unlike ranks.
//
// A rank's predicted step time with b samples is
//   fixedSeconds + b * (c + t)          input copied, then computed on
//   fixedSeconds + b * max(c, t)        input copied on a side stream while the device
//                                       computes (prefetch): the larger of the two
// with c = secondsPerSample (compute) and t = bytesPerSample / linkBytesPerSecond (the
// input over the rank's host link); a rank holds at most maxSamples (memory).
// solveSplit() finds integer local batches summing to the global batch, within the
// caps, that minimise the slowest rank's predicted time: exactly (tests compare with
// brute force), in microseconds for tens of ranks. Every rank computing it from the
// same inputs gets the same plan (ties go to the lower rank).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace hddp {

struct RankCost {
  double secondsPerSample = 0.0;
  double fixedSeconds = 0.0;
  double bytesPerSample = 0.0;
  /// 0 = the link does not limit this rank.
  double linkBytesPerSecond = 0.0;
  /// Input copies overlap compute (a prefetching loader on a side stream).
  bool transferOverlapped = false;
  int64_t maxSamples = std::numeric_limits<int64_t>::max();

  /// Seconds per sample of input over the link (0 without a link term).
  double transferSecondsPerSample() const {
    return linkBytesPerSecond > 0 ? bytesPerSample / linkBytesPerSecond : 0.0;
  }
  double perSampleSeconds() const {
    const double t = transferSecondsPerSample();
    return transferOverlapped ? (secondsPerSample > t ? secondsPerSample : t)
                              : secondsPerSample + t;
  }
  double predict(int64_t samples) const {
    return fixedSeconds + static_cast<double>(samples) * perSampleSeconds();
  }
};

/// A cost as 5 numbers (for exchanges and state files): seconds per sample, fixed
/// seconds, bytes per sample, link bytes/s, copies overlapped (1/0); the cap is apart.
constexpr size_t kRankCostFields = 5;
std::array<double, kRankCostFields> costFields(const RankCost& cost);
RankCost costFromFields(const double* fields);

struct BatchPlan {
  std::vector<int64_t> local;
  int64_t global = 0;
  /// The slowest rank's predicted step time (seconds) under the costs used.
  double predictedStepSeconds = 0.0;

  /// First sample of `rank`'s share within the step's global batch.
  int64_t offsetOf(int rank) const;
  std::string describe() const;  // "[96, 32] of 128"
};

/// The optimal split; throws hddp::ConfigError for invalid costs or when the caps
/// cannot hold the global batch.
BatchPlan solveSplit(const std::vector<RankCost>& ranks, int64_t globalBatch);

/// Equal split (PyTorch DDP's): B / n each, the remainder to the first ranks.
BatchPlan equalSplit(int worldSize, int64_t globalBatch);

/// `plan` rescaled to `total` samples by largest remainders (deterministic), e.g. for
/// the last, partial batch of an epoch; every rank gets at least `minLocal` (taken from
/// the largest shares). Needs total >= ranks x minLocal.
BatchPlan scalePlan(const BatchPlan& plan, int64_t total, int64_t minLocal = 0);

/// Items [begin, end) of a collection.
struct ItemRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

/// `rank`'s contiguous part of `items` items split in proportion to the plan's shares,
/// e.g. an evaluation set spread like the training batch, so each rank's evaluation time
/// follows its speed. The parts of ranks 0..n-1 follow each other and cover every item
/// exactly once. A plan whose shares sum to 0 splits equally.
ItemRange shardOf(int64_t items, const BatchPlan& plan, int rank);

/// Max over ranks of ranks[i].predict(plan.local[i]).
double predictedSeconds(const std::vector<RankCost>& ranks, const std::vector<int64_t>& local);

}  // namespace hddp
