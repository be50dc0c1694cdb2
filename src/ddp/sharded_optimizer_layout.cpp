// ShardedOptimizer (hddp/ddp/sharded_optimizer.h): which rank owns which parameters
// (ShardLayout, ShardBy) and the free-memory weights that size the shards.
#include "hddp/ddp/sharded_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"

namespace hddp {

namespace {

std::string elementsText(int64_t n) {
  std::ostringstream os;
  os.precision(3);
  if (n >= 1000000) {
    os << static_cast<double>(n) / 1e6 << " M";
  } else if (n >= 1000) {
    os << static_cast<double>(n) / 1e3 << " k";
  } else {
    os << n;
  }
  return os.str();
}

}  // namespace

std::string ShardLayout::describe() const {
  int64_t total = 0;
  for (int64_t e : elements) {
    total += e;
  }
  std::ostringstream os;
  os.precision(3);
  for (int r = 0; r < ranks(); ++r) {
    os << (r ? "; " : "") << "rank " << r << ": " << (end[r] - begin[r]) << " tensor(s), "
       << elementsText(elements[r]) << " elements ("
       << (total > 0 ? 100.0 * static_cast<double>(elements[r]) / static_cast<double>(total) : 0.0)
       << "%)";
  }
  return os.str();
}

ShardLayout shardLayout(const std::vector<int64_t>& numels, const std::vector<double>& weights) {
  HDDP_CHECK_AS(ConfigError, !weights.empty(), "shardLayout: no weights (one per rank)");
  double sum = 0;
  for (size_t r = 0; r < weights.size(); ++r) {
    HDDP_CHECK_AS(ConfigError, std::isfinite(weights[r]) && weights[r] >= 0,
                  "shard weights must be finite and >= 0; rank ", r, "'s is ", weights[r]);
    sum += weights[r];
  }
  HDDP_CHECK_AS(ConfigError, sum > 0, "shard weights are all 0: no rank would own anything");
  const int n = static_cast<int>(weights.size());
  int64_t total = 0;
  for (int64_t e : numels) {
    total += e;
  }
  // Rank r's part of the element line is [bound[r], bound[r+1]).
  std::vector<double> bound(static_cast<size_t>(n) + 1, 0.0);
  for (int r = 0; r < n; ++r) {
    bound[r + 1] = bound[r] + static_cast<double>(total) * weights[r] / sum;
  }
  bound[n] = static_cast<double>(total) + 1.0;  // the last tensor always has an owner
  ShardLayout layout;
  layout.owner.resize(numels.size());
  layout.begin.assign(n, 0);
  layout.end.assign(n, 0);
  layout.elements.assign(n, 0);
  int64_t start = 0;
  int rank = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    const double mid = static_cast<double>(start) + static_cast<double>(numels[i]) / 2.0;
    while (rank + 1 < n && mid >= bound[rank + 1]) {
      ++rank;
    }
    layout.owner[i] = rank;
    layout.elements[rank] += numels[i];
    start += numels[i];
  }
  // Ranges from the owners (contiguous by construction); an empty rank's range is empty
  // at the place where it would begin.
  int next = 0;
  for (int r = 0; r < n; ++r) {
    layout.begin[r] = next;
    while (next < static_cast<int>(numels.size()) && layout.owner[next] == r) {
      ++next;
    }
    layout.end[r] = next;
  }
  HDDP_INTERNAL_ASSERT(next == static_cast<int>(numels.size()), "shard ranges are not contiguous");
  return layout;
}

ShardBy parseShardBy(const std::string& text) {
  ShardBy by;
  if (text == "memory") {
    by.kind = ShardBy::Kind::Memory;
    return by;
  }
  if (text == "equal") {
    by.kind = ShardBy::Kind::Equal;
    return by;
  }
  by.kind = ShardBy::Kind::Ratios;
  std::stringstream in(text);
  std::string item;
  double sum = 0;
  while (std::getline(in, item, ':')) {
    char* endp = nullptr;
    const double v = std::strtod(item.c_str(), &endp);
    HDDP_CHECK_AS(ConfigError,
                  !item.empty() && endp != nullptr && *endp == '\0' && std::isfinite(v) && v >= 0,
                  "--shard-by '", text, "': '", item,
                  "' is not a number >= 0. Give memory, equal, or one ratio per rank (1:3)");
    by.ratios.push_back(v);
    sum += v;
  }
  HDDP_CHECK_AS(ConfigError, !by.ratios.empty() && sum > 0, "--shard-by '", text,
                "': give memory, equal, or one ratio per rank, not all 0 (1:3)");
  return by;
}

std::string describeShardBy(const ShardBy& by) {
  switch (by.kind) {
    case ShardBy::Kind::Memory:
      return "memory";
    case ShardBy::Kind::Equal:
      return "equal";
    case ShardBy::Kind::Ratios: {
      std::ostringstream os;
      for (size_t i = 0; i < by.ratios.size(); ++i) {
        os << (i ? ":" : "") << by.ratios[i];
      }
      return os.str();
    }
  }
  return "?";
}

std::vector<double> memoryShardWeights(Communicator& communicator, double freeBytes) {
  // Gathered first and checked after, on every rank alike: a check before the
  // collective would fail one rank while the others wait in it.
  std::vector<uint8_t> mine(sizeof(double));
  std::memcpy(mine.data(), &freeBytes, sizeof(double));
  const auto all = communicator.allgatherBytes(mine);
  std::vector<double> weights;
  double sum = 0;
  for (size_t r = 0; r < all.size(); ++r) {
    HDDP_INTERNAL_ASSERT(all[r].size() == sizeof(double), "a rank's free bytes are not a double");
    double v = 0;
    std::memcpy(&v, all[r].data(), sizeof(double));
    HDDP_CHECK_AS(ConfigError, std::isfinite(v), "memoryShardWeights: rank ", r,
                  " reports free bytes ", v, ", not a number");
    weights.push_back(std::max(0.0, v));
    sum += weights.back();
  }
  HDDP_CHECK_AS(ConfigError, sum > 0,
                "sharding by memory: no rank reports free device memory after the model. Give "
                "the shares with --shard-by R0:R1:... (or equal), or an emulated total with "
                "--emulate-memory");
  return weights;
}

}  // namespace hddp
