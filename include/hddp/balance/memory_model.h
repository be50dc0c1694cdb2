// Memory caps derived from measurement, before any out-of-memory error.
//
// Each step a rank records what its memory did: the bytes it held when the step began
// (parameters, gradients, optimizer state), the step's peak (on a device: the caching
// allocator's peak allocated bytes), the device's total and what others hold on it.
// A MemoryEstimator fits memory(b) = fixed + perSample x b over the recent steps and
// derives the largest share b that fits the rank's budget:
//
//   budget = total x (1 - headroom) - others        cap = floor((budget - fixed) / perSample)
//
// The planner exchanges the derived caps with its estimates, so no rank is planned a
// share its memory cannot hold (docs/balance.md, "Memory caps"). An out-of-memory error
// still teaches a cap (the fallback when memory grows faster than the line predicts).
#pragma once

#include <cstdint>
#include <deque>
#include <string>

namespace hddp {

/// What one step's memory did on a rank (bytes; 0 = not measured).
struct MemoryObservation {
  int64_t samples = 0;
  /// Held when the step began: what does not grow with the batch.
  double baseBytes = 0.0;
  /// The step's peak: base plus what the batch needed (activations, workspace).
  double peakBytes = 0.0;
  /// The device's memory; 0: unknown (no cap is derived).
  double totalBytes = 0.0;
  /// Held by others on the device (other processes, the driver's context): total
  /// minus free minus what this process's allocator reserved.
  double otherBytes = 0.0;
};

/// A rank's memory as fixed + perSample x b, from its recent steps.
class MemoryEstimator {
 public:
  /// `window`: most recent steps kept.
  explicit MemoryEstimator(int window = 20);
  /// Steps without samples or without a total are ignored.
  void record(const MemoryObservation& o);

  struct Fit {
    double fixedBytes = 0.0;
    double perSampleBytes = 0.0;  // 0: memory did not grow with the batch (no cap)
    double totalBytes = 0.0;      // the newest step's
    double otherBytes = 0.0;      // the newest step's
    int steps = 0;                // 0: nothing measured
  };
  /// With steps of two or more sizes, a robust line through the peaks (the median of
  /// the pairwise slopes, then the median intercept); with one size, fixed = the
  /// median base and perSample = the median of (peak - base) / b.
  Fit fit() const;
  /// The largest share that fits, keeping `headroom` (a fraction of the device's
  /// memory) free; std::numeric_limits<int64_t>::max() when there is nothing to go by.
  int64_t cap(double headroom) const { return capFor(fit(), headroom); }
  static int64_t capFor(const Fit& fit, double headroom);
  /// "200.0 MiB + 12.00 MiB/sample of 1000.0 MiB (others 0.0 MiB)".
  static std::string describe(const Fit& fit);

  void clear() { steps_.clear(); }

 private:
  int window_;
  std::deque<MemoryObservation> steps_;
};

}  // namespace hddp
