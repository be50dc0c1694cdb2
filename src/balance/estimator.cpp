// RankEstimator: one rank's running estimate of its costs from its recent steps (see
// hddp/balance/planner.h): a robust fit of f + c b, transfer per sample, the standard
// error, level shifts.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "balance/statistics.h"
#include "hddp/balance/planner.h"
#include "hddp/core/error.h"

namespace hddp {
namespace {

using balance::median;

// Median and the standard error of the median (normal errors: 1.2533 sigma / sqrt(n),
// sigma from the median absolute deviation, 1.4826 MAD), in absolute units.
struct Location {
  double median = 0.0;
  double error = 0.0;
};

Location locate(const std::vector<double>& v) {
  Location l;
  l.median = median(v);
  if (v.size() < 2) {
    l.error = 0.5 * std::abs(l.median);  // one step: no spread to go by
    return l;
  }
  std::vector<double> deviation;
  for (double x : v) {
    deviation.push_back(std::abs(x - l.median));
  }
  l.error = 1.2533 * 1.4826 * median(deviation) / std::sqrt(static_cast<double>(v.size()));
  return l;
}

// The mean of the middle 60% (20% trimmed each side): nearly as efficient as the mean
// for light-tailed noise, and a slow outlier step (a page fault, a collector) does not
// move it. With fewer than 5 values, the median.
constexpr double kTrim = 0.2;

double trimmedMean(std::vector<double> v) {
  if (v.size() < 5) {
    return median(v);
  }
  std::sort(v.begin(), v.end());
  const auto g = static_cast<size_t>(kTrim * static_cast<double>(v.size()));
  double sum = 0.0;
  for (size_t i = g; i < v.size() - g; ++i) {
    sum += v[i];
  }
  return sum / static_cast<double>(v.size() - 2 * g);
}

// The standard deviation of the trimmed mean's terms: the winsorized standard deviation
// over (1 - 2 x trim) (Tukey-McLaughlin); the trimmed mean's standard error is this
// over sqrt(n).
double trimmedSpread(std::vector<double> v) {
  if (v.size() < 2) {
    return 0.5 * std::abs(median(v));  // one step: no spread to go by
  }
  std::sort(v.begin(), v.end());
  const auto g = static_cast<size_t>(kTrim * static_cast<double>(v.size()));
  for (size_t i = 0; i < g; ++i) {
    v[i] = v[g];
    v[v.size() - 1 - i] = v[v.size() - 1 - g];
  }
  double mean = 0.0;
  for (double x : v) {
    mean += x;
  }
  mean /= static_cast<double>(v.size());
  double ss = 0.0;
  for (double x : v) {
    ss += (x - mean) * (x - mean);
  }
  const double sd = std::sqrt(ss / static_cast<double>(v.size() - 1));
  return sd / (1.0 - 2.0 * kTrim);
}

// Compute time f + c b fitted to steps [from, to).
struct Fit {
  double perSample = 0.0;
  double fixed = 0.0;
};

// The fixed part as measured (the steps' tails, e.g. the optimizer step), the rest per
// sample: a 20%-trimmed mean.
Fit proportionalFit(const std::deque<RankEstimator::Sample>& w, size_t from, size_t to) {
  Fit fit;
  std::vector<double> fixed;
  std::vector<double> perSample;
  for (size_t i = from; i < to; ++i) {
    fixed.push_back(w[i].fixed);
  }
  fit.fixed = median(fixed);
  for (size_t i = from; i < to; ++i) {
    perSample.push_back(std::max(w[i].compute - fit.fixed, 0.1 * w[i].compute) / w[i].samples);
  }
  fit.perSample = trimmedMean(perSample);
  return fit;
}

double ratioSpread(const std::deque<RankEstimator::Sample>& w, size_t from, size_t to,
                   const Fit& fit);

// When the window holds steps of clearly different sizes, interleaved in time, a
// Theil-Sen line (median of pairwise slopes, median intercept) can find a per-step
// overhead that the measured tail does not hold. It replaces the proportional fit only
// when it also explains the steps markedly better (their scatter around it at most 2/3
// of that around the proportional fit). One plan change is not enough: the steps before
// it and after it form two clusters in time, a line passes through both, and a change
// of the machine's load between them (on shared cores the split itself changes it)
// would read as a large overhead and a small per-sample cost, and the next plan
// overshoots (seen in bench/hetero_compare.py: 25 -> 48 -> 73 -> 61 -> 48).
Fit fitCompute(const std::deque<RankEstimator::Sample>& w, size_t from, size_t to) {
  const Fit proportional = proportionalFit(w, from, to);
  double lo = std::numeric_limits<double>::max();
  double hi = 0.0;
  for (size_t i = from; i < to; ++i) {
    lo = std::min(lo, w[i].samples);
    hi = std::max(hi, w[i].samples);
  }
  // Sizes that went back and forth (at least 3 changes along the window), so that a
  // change of the machine's speed over time is not read as a function of the size.
  int changes = 0;
  for (size_t i = from + 1; i < to; ++i) {
    changes += w[i].samples != w[i - 1].samples ? 1 : 0;
  }
  if (changes >= 3 && hi >= 1.25 * lo) {
    std::vector<double> slopes;
    for (size_t i = from; i < to; ++i) {
      for (size_t j = i + 1; j < to; ++j) {
        if (w[i].samples != w[j].samples) {
          slopes.push_back((w[j].compute - w[i].compute) / (w[j].samples - w[i].samples));
        }
      }
    }
    Fit line;
    line.perSample = median(slopes);
    if (line.perSample > 0) {
      std::vector<double> intercepts;
      for (size_t i = from; i < to; ++i) {
        intercepts.push_back(w[i].compute - line.perSample * w[i].samples);
      }
      line.fixed = std::max(0.0, median(intercepts));
      if (ratioSpread(w, from, to, line) <= (2.0 / 3.0) * ratioSpread(w, from, to, proportional)) {
        return line;
      }
    }
  }
  return proportional;
}

// Measured time over the fit's prediction, per step (1 = as predicted).
std::vector<double> ratios(const std::deque<RankEstimator::Sample>& w, size_t from, size_t to,
                           const Fit& fit) {
  std::vector<double> out;
  for (size_t i = from; i < to; ++i) {
    const double predicted = fit.fixed + fit.perSample * w[i].samples;
    out.push_back(predicted > 0 ? w[i].compute / predicted : 1.0);
  }
  return out;
}

double ratioSpread(const std::deque<RankEstimator::Sample>& w, size_t from, size_t to,
                   const Fit& fit) {
  return trimmedSpread(ratios(w, from, to, fit));
}

std::vector<double> transferPerSample(const std::deque<RankEstimator::Sample>& w, size_t from,
                                      size_t to) {
  std::vector<double> out;
  for (size_t i = from; i < to; ++i) {
    out.push_back(w[i].transfer / w[i].samples);
  }
  return out;
}

}  // namespace

RankEstimator::RankEstimator(int window, double confidence, int newest)
    : window_(window), confidence_(confidence), newest_(newest) {
  HDDP_CHECK_AS(ConfigError, window >= 1 && newest >= 1 && confidence >= 0,
                "RankEstimator: window ", window, ", newest ", newest, ", confidence ", confidence,
                " must be positive");
}

void RankEstimator::record(const StepMeasurement& m) {
  if (m.samples <= 0 || !(m.computeSeconds > 0) || !std::isfinite(m.computeSeconds)) {
    return;  // no samples this step: nothing learnt about the speed
  }
  Sample s;
  s.samples = static_cast<double>(m.samples);
  s.compute = m.computeSeconds;
  s.fixed = std::clamp(m.fixedSeconds, 0.0, 0.9 * m.computeSeconds);
  s.transfer = std::max(0.0, m.transferSeconds);
  s.bytes = static_cast<double>(std::max<int64_t>(0, m.bytes));
  samples_.push_back(s);
  while (static_cast<int>(samples_.size()) > window_) {
    samples_.pop_front();
  }
}

void RankEstimator::restore(std::deque<Sample> samples) {
  samples_ = std::move(samples);
  pastRatios_.clear();
  while (static_cast<int>(samples_.size()) > window_) {
    samples_.pop_front();
  }
}

RankEstimator::Estimate RankEstimator::estimate() {
  const size_t n = samples_.size();
  // A level shift: do the newest steps take what the older ones predict, in compute
  // and in transfer per sample?
  // One more standard error than a plan change needs: a false shift only shrinks the
  // window, but it should be rare.
  const size_t m = std::min<size_t>(static_cast<size_t>(newest_), n / 2);
  if (m >= 4 && confidence_ > 0) {
    auto differ = [&](const Location& older, const Location& newer) {
      const double difference = std::abs(newer.median - older.median);
      return difference > (confidence_ + 1.0) * std::hypot(newer.error, older.error) &&
             difference > 0.05 * std::max(std::abs(older.median), std::abs(newer.median));
    };
    const Fit older = fitCompute(samples_, 0, n - m);
    const bool computeShifted = differ(locate(ratios(samples_, 0, n - m, older)),
                                       locate(ratios(samples_, n - m, n, older)));
    const bool transferShifted = differ(locate(transferPerSample(samples_, 0, n - m)),
                                        locate(transferPerSample(samples_, n - m, n)));
    if (computeShifted || transferShifted) {
      // The older steps leave the estimate; their scatter around their own level stays
      // in the noise estimate, which a short new window would understate.
      for (double r : ratios(samples_, 0, n - m, older)) {
        pastRatios_.push_back(r);
      }
      samples_.erase(samples_.begin(), samples_.end() - static_cast<std::ptrdiff_t>(m));
      ++shifts_;
    }
  }
  Estimate e;
  const size_t k = samples_.size();
  e.steps = static_cast<int>(k);
  if (k == 0) {
    return e;
  }
  const Fit fit = fitCompute(samples_, 0, k);
  e.secondsPerSample = fit.perSample;
  e.fixedSeconds = fit.fixed;
  // The standard error of the level from the scatter of the ratios (median ~1, so it
  // is relative), the dropped steps' scatter included, over the steps behind it.
  while (pastRatios_.size() + k > static_cast<size_t>(window_)) {
    pastRatios_.pop_front();
  }
  std::vector<double> scatter = ratios(samples_, 0, k, fit);
  scatter.insert(scatter.end(), pastRatios_.begin(), pastRatios_.end());
  // A spread measured on few steps is itself uncertain (Student's t): widen the error
  // for short windows, about as t's 99.9% quantile exceeds the normal's.
  const auto steps = static_cast<double>(k);
  e.relativeError = trimmedSpread(scatter) / std::sqrt(steps) * (1.0 + 3.0 / steps);
  e.transferSecondsPerSample = median(transferPerSample(samples_, 0, k));
  std::vector<double> bytes;
  for (const auto& s : samples_) {
    bytes.push_back(s.bytes / s.samples);
  }
  e.bytesPerSample = median(bytes);
  return e;
}

}  // namespace hddp
