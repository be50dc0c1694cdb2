// A rank's running estimate of its own costs (RankEstimator), from what its steps
// measured (StepMeasurement): the planner's input (hddp/balance/planner.h). Median-based
// and robust to a slow step; drops its older steps when the newest show a level shift
// (a card that throttles, a link that drops). Used from the rank's training thread.
#pragma once

#include <cstdint>
#include <deque>

namespace hddp {

/// What one step of one rank measured.
struct StepMeasurement {
  int64_t samples = 0;
  /// Compute seconds (communication waits left out), fixedSeconds included.
  double computeSeconds = 0.0;
  /// The part that does not grow with the batch (the optimizer step); 0 = unknown.
  double fixedSeconds = 0.0;
  /// Seconds the step's input took over the rank's link; 0 = not measured.
  double transferSeconds = 0.0;
  /// Bytes of input the step moved over the link.
  int64_t bytes = 0;
};

/// A rank's running estimate of its costs, from its recent steps.
///
/// Compute time is modelled as f + c b for b samples. When the window holds steps of
/// different sizes, c and f come from a robust line fit (Theil-Sen: the median of the
/// pairwise slopes), so a per-step overhead (kernel launches, hooks) is not charged per
/// sample; otherwise f is the median of the steps' fixed part (the optimizer step) and c
/// the median of (time - f) / b.
class RankEstimator {
 public:
  /// `window`: most recent steps kept; `confidence`: standard errors that make a level
  /// shift between the newest `newest` steps and the older ones real.
  explicit RankEstimator(int window = 20, double confidence = 3.0, int newest = 10);

  void record(const StepMeasurement& m);

  struct Estimate {
    /// Compute seconds per sample; 0 = nothing measured.
    double secondsPerSample = 0.0;
    /// Standard error of the compute time at the measured sizes, relative to it
    /// (1.86 MAD of the residual ratios / sqrt(steps)).
    double relativeError = 0.0;
    double fixedSeconds = 0.0;
    /// Median input transfer seconds per sample; 0 = not measured.
    double transferSecondsPerSample = 0.0;
    double bytesPerSample = 0.0;
    int steps = 0;
  };
  /// The estimate from the steps since the last level shift. First drops the older
  /// steps when the newest differ from what the older ones predict by more than
  /// `confidence` combined standard errors (and 5%).
  Estimate estimate();

  /// One recorded step.
  struct Sample {
    double samples = 0.0;
    double compute = 0.0;  // seconds, fixed part included
    double fixed = 0.0;    // seconds of the part that does not grow with the batch
    double transfer = 0.0;
    double bytes = 0.0;
    bool operator==(const Sample& o) const {
      return samples == o.samples && compute == o.compute && fixed == o.fixed &&
             transfer == o.transfer && bytes == o.bytes;
    }
  };
  const std::deque<Sample>& samples() const { return samples_; }
  void restore(std::deque<Sample> samples);
  /// Level shifts detected so far.
  int shifts() const { return shifts_; }

 private:
  int window_;
  double confidence_;
  int newest_;
  std::deque<Sample> samples_;
  std::deque<double> pastRatios_;  // steps dropped at a shift: their scatter only
  int shifts_ = 0;
};

}  // namespace hddp
