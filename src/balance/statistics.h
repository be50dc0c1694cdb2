// Small robust statistics shared by the balance layer's estimators (internal).
#pragma once

#include <algorithm>
#include <vector>

namespace hddp {
namespace balance {

/// The median of `v` (the mean of the middle two for an even count); 0 when empty.
inline double median(std::vector<double> v) {
  if (v.empty()) {
    return 0.0;
  }
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace balance
}  // namespace hddp
