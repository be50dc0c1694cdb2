// MemoryEstimator: a rank's memory as fixed + perSample x b, and the cap it implies
// (see hddp/balance/memory_model.h).
#include "hddp/balance/memory_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "balance/statistics.h"
#include "hddp/core/error.h"

namespace hddp {
namespace {

using balance::median;

}  // namespace

MemoryEstimator::MemoryEstimator(int window) : window_(window) {
  HDDP_CHECK_AS(ConfigError, window >= 1, "MemoryEstimator: window must be >= 1, got ", window);
}

void MemoryEstimator::record(const MemoryObservation& o) {
  if (o.samples <= 0 || !(o.totalBytes > 0) || !(o.peakBytes > 0)) {
    return;
  }
  steps_.push_back(o);
  while (static_cast<int>(steps_.size()) > window_) {
    steps_.pop_front();
  }
}

MemoryEstimator::Fit MemoryEstimator::fit() const {
  Fit f;
  if (steps_.empty()) {
    return f;
  }
  f.steps = static_cast<int>(steps_.size());
  f.totalBytes = steps_.back().totalBytes;
  f.otherBytes = steps_.back().otherBytes;
  std::vector<double> slopes;
  for (size_t i = 0; i < steps_.size(); ++i) {
    for (size_t j = i + 1; j < steps_.size(); ++j) {
      const auto db = static_cast<double>(steps_[j].samples - steps_[i].samples);
      if (db != 0) {
        slopes.push_back((steps_[j].peakBytes - steps_[i].peakBytes) / db);
      }
    }
  }
  std::vector<double> intercepts;
  if (!slopes.empty()) {
    f.perSampleBytes = median(slopes);
    for (const auto& s : steps_) {
      intercepts.push_back(s.peakBytes - f.perSampleBytes * static_cast<double>(s.samples));
    }
    f.fixedBytes = median(intercepts);
  } else {
    std::vector<double> perSample;
    for (const auto& s : steps_) {
      intercepts.push_back(s.baseBytes);
      perSample.push_back((s.peakBytes - s.baseBytes) / static_cast<double>(s.samples));
    }
    f.fixedBytes = median(intercepts);
    f.perSampleBytes = median(perSample);
  }
  f.perSampleBytes = std::max(0.0, f.perSampleBytes);
  return f;
}

int64_t MemoryEstimator::capFor(const Fit& f, double headroom) {
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  if (f.steps == 0 || !(f.perSampleBytes > 0) || !(f.totalBytes > 0)) {
    return kNone;
  }
  const double budget = f.totalBytes * (1.0 - headroom) - f.otherBytes;
  const double cap = std::floor((budget - f.fixedBytes) / f.perSampleBytes);
  if (!(cap < 1e15)) {
    return kNone;
  }
  return static_cast<int64_t>(std::max(0.0, cap));
}

std::string MemoryEstimator::describe(const Fit& f) {
  if (f.steps == 0) {
    return "no device memory measured";
  }
  constexpr double kMiB = 1024.0 * 1024.0;
  char b[160];
  std::snprintf(b, sizeof(b), "%.1f MiB + %.2f MiB/sample of %.1f MiB (others %.1f MiB)",
                f.fixedBytes / kMiB, f.perSampleBytes / kMiB, f.totalBytes / kMiB,
                f.otherBytes / kMiB);
  return b;
}

}  // namespace hddp
