#include "hddp/balance/batch_plan.h"

#include <algorithm>
#include <cmath>
#include <queue>
#include <sstream>

#include "hddp/core/error.h"

namespace hddp {

std::array<double, kRankCostFields> costFields(const RankCost& c) {
  return {c.secondsPerSample, c.fixedSeconds, c.bytesPerSample, c.linkBytesPerSecond,
          c.transferOverlapped ? 1.0 : 0.0};
}

RankCost costFromFields(const double* f) {
  RankCost c;
  c.secondsPerSample = f[0];
  c.fixedSeconds = f[1];
  c.bytesPerSample = f[2];
  c.linkBytesPerSecond = f[3];
  c.transferOverlapped = f[4] > 0.5;
  return c;
}

int64_t BatchPlan::offsetOf(int rank) const {
  HDDP_CHECK(rank >= 0 && rank < static_cast<int>(local.size()), "BatchPlan::offsetOf: rank ", rank,
             " is not in a plan of ", local.size(), " ranks");
  int64_t offset = 0;
  for (int r = 0; r < rank; ++r) {
    offset += local[r];
  }
  return offset;
}

std::string BatchPlan::describe() const {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < local.size(); ++i) {
    os << (i ? ", " : "") << local[i];
  }
  os << "] of " << global;
  return os.str();
}

double predictedSeconds(const std::vector<RankCost>& ranks, const std::vector<int64_t>& local) {
  double worst = 0.0;
  for (size_t i = 0; i < ranks.size() && i < local.size(); ++i) {
    worst = std::max(worst, ranks[i].predict(local[i]));
  }
  return worst;
}

BatchPlan equalSplit(int worldSize, int64_t globalBatch) {
  HDDP_CHECK_AS(ConfigError, worldSize >= 1 && globalBatch >= 0, "equalSplit: ", worldSize,
                " ranks, batch ", globalBatch);
  BatchPlan plan;
  plan.global = globalBatch;
  for (int r = 0; r < worldSize; ++r) {
    plan.local.push_back(globalBatch / worldSize + (r < globalBatch % worldSize ? 1 : 0));
  }
  return plan;
}

BatchPlan scalePlan(const BatchPlan& plan, int64_t total, int64_t minLocal) {
  HDDP_CHECK(total >= 0 && !plan.local.empty(), "scalePlan: total ", total, " for a plan of ",
             plan.local.size(), " ranks");
  const auto n = static_cast<int64_t>(plan.local.size());
  HDDP_CHECK(minLocal >= 0 && total >= n * minLocal, "scalePlan: ", total,
             " samples cannot give each of ", n, " ranks at least ", minLocal);
  BatchPlan out;
  out.global = total;
  if (plan.global <= 0) {
    return equalSplit(static_cast<int>(plan.local.size()), total);
  }
  std::vector<std::pair<double, size_t>> remainders;
  int64_t assigned = 0;
  for (size_t i = 0; i < plan.local.size(); ++i) {
    const double exact = static_cast<double>(plan.local[i]) * static_cast<double>(total) /
                         static_cast<double>(plan.global);
    const auto whole = static_cast<int64_t>(std::floor(exact));
    out.local.push_back(whole);
    assigned += whole;
    remainders.emplace_back(exact - static_cast<double>(whole), i);
  }
  std::stable_sort(remainders.begin(), remainders.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t k = 0; assigned < total; ++k, ++assigned) {
    ++out.local[remainders[k % remainders.size()].second];
  }
  // Raise ranks below the minimum, one sample at a time from the largest share
  // (deterministic: the lowest rank among equals), so the sum stays `total`.
  for (size_t i = 0; i < out.local.size(); ++i) {
    while (out.local[i] < minLocal) {
      const auto largest = std::max_element(out.local.begin(), out.local.end());
      HDDP_INTERNAL_ASSERT(*largest > minLocal, "scalePlan: no share above the minimum");
      --*largest;
      ++out.local[i];
    }
  }
  return out;
}

BatchPlan solveSplit(const std::vector<RankCost>& ranks, int64_t globalBatch) {
  HDDP_CHECK_AS(ConfigError, !ranks.empty(), "solveSplit needs at least one rank");
  HDDP_CHECK_AS(ConfigError, globalBatch >= 0, "solveSplit: the global batch must be >= 0, got ",
                globalBatch);
  const size_t n = ranks.size();
  int64_t capacity = 0;
  double floorTime = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const RankCost& c = ranks[i];
    HDDP_CHECK_AS(ConfigError,
                  std::isfinite(c.secondsPerSample) && c.secondsPerSample >= 0 &&
                      std::isfinite(c.fixedSeconds) && c.fixedSeconds >= 0 &&
                      c.bytesPerSample >= 0 && c.linkBytesPerSecond >= 0 && c.maxSamples >= 0,
                  "rank ", i, " has an invalid cost (", c.secondsPerSample, " s/sample, ",
                  c.fixedSeconds, " s fixed, ", c.bytesPerSample, " B/sample over ",
                  c.linkBytesPerSecond, " B/s, cap ", c.maxSamples, ")");
    capacity = c.maxSamples > std::numeric_limits<int64_t>::max() - capacity
                   ? std::numeric_limits<int64_t>::max()
                   : capacity + c.maxSamples;
    floorTime = std::max(floorTime, c.fixedSeconds);
  }
  HDDP_CHECK_AS(ConfigError, capacity >= globalBatch, "the global batch ", globalBatch,
                " does not fit the ranks' memory caps (", capacity,
                " samples in all); lower the global batch or add ranks");
  // Lower bound of the optimum from the continuous relaxation, then greedy: the greedy
  // step gives the next sample to the rank whose time after it is smallest. Starting
  // from any allocation whose every rank is within the optimum T*, each greedy step
  // stays within T* (some rank below its T*-capacity always remains), so the result is
  // optimal. The start only saves greedy steps.
  auto fits = [&](double t) {
    double total = 0.0;
    for (const auto& c : ranks) {
      const double per = c.perSampleSeconds();
      const double can =
          per > 0 ? std::max(0.0, (t - c.fixedSeconds) / per) : static_cast<double>(c.maxSamples);
      total += std::min(can, static_cast<double>(c.maxSamples));
      if (total >= static_cast<double>(globalBatch)) {
        return true;
      }
    }
    return false;
  };
  double lo = floorTime;
  double hi = floorTime;
  for (const auto& c : ranks) {
    hi = std::max(hi, c.predict(globalBatch));
  }
  for (int it = 0; it < 60 && hi - lo > 1e-12 * std::max(1.0, hi); ++it) {
    const double mid = 0.5 * (lo + hi);
    (fits(mid) ? hi : lo) = mid;
  }
  std::vector<int64_t> local(n, 0);
  int64_t assigned = 0;
  for (size_t i = 0; i < n; ++i) {
    const double per = ranks[i].perSampleSeconds();
    if (per <= 0) {
      continue;
    }
    const double can = std::floor((lo - ranks[i].fixedSeconds) / per) - 1.0;
    local[i] = std::max<int64_t>(
        0, std::min<int64_t>(ranks[i].maxSamples, static_cast<int64_t>(std::max(0.0, can))));
    assigned += local[i];
  }
  if (assigned > globalBatch) {
    std::fill(local.begin(), local.end(), 0);
    assigned = 0;
  }
  using Entry = std::pair<double, size_t>;  // (time after one more sample, rank)
  auto later = [](const Entry& a, const Entry& b) {
    return a.first > b.first || (a.first == b.first && a.second > b.second);
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(later)> next(later);
  for (size_t i = 0; i < n; ++i) {
    if (local[i] < ranks[i].maxSamples) {
      next.emplace(ranks[i].predict(local[i] + 1), i);
    }
  }
  while (assigned < globalBatch) {
    const auto [time, i] = next.top();
    next.pop();
    ++local[i];
    ++assigned;
    if (local[i] < ranks[i].maxSamples) {
      next.emplace(ranks[i].predict(local[i] + 1), i);
    }
  }
  BatchPlan plan;
  plan.local = std::move(local);
  plan.global = globalBatch;
  plan.predictedStepSeconds = predictedSeconds(ranks, plan.local);
  return plan;
}

ItemRange shardOf(int64_t items, const BatchPlan& plan, int rank) {
  const auto n = static_cast<int>(plan.local.size());
  HDDP_CHECK(items >= 0, "shardOf: ", items, " items");
  HDDP_CHECK(rank >= 0 && rank < n, "shardOf: rank ", rank, " is outside a plan of ", n, " ranks");
  int64_t total = 0;
  for (int64_t b : plan.local) {
    HDDP_CHECK(b >= 0, "shardOf: the plan ", plan.describe(), " has a negative share");
    total += b;
  }
  // The first item of rank r's part: items x (shares before r) / total, rounded down.
  auto boundary = [&](int r) -> int64_t {
    if (r == n) {
      return items;
    }
    if (total == 0) {
      return static_cast<int64_t>(static_cast<__int128>(items) * r / n);
    }
    int64_t before = 0;
    for (int i = 0; i < r; ++i) {
      before += plan.local[static_cast<size_t>(i)];
    }
    return static_cast<int64_t>(static_cast<__int128>(items) * before / total);
  };
  return ItemRange{boundary(rank), boundary(rank + 1)};
}

}  // namespace hddp
