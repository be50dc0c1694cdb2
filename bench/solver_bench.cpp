// Time of hddp::solveSplit for n ranks and a global batch B (random unlike costs, caps
// on a quarter of the ranks), median of many calls, next to an equal split's time as
// the floor. Prints one line per (n, B).
//   solver_bench
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "hddp/balance/batch_plan.h"

int main() {
  std::mt19937 rng(1);
  std::uniform_real_distribution<double> speed(0.001, 0.05);
  std::printf("%6s %7s %14s %14s\n", "ranks", "batch", "solve us", "equal us");
  for (int n : {2, 8, 64, 256}) {
    for (int64_t B : {256, 4096, 65536}) {
      std::vector<hddp::RankCost> costs(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) {
        costs[i].secondsPerSample = speed(rng);
        costs[i].fixedSeconds = 0.002 * (i % 3);
        costs[i].bytesPerSample = 12288;
        costs[i].linkBytesPerSecond = i % 4 == 0 ? 2.8e9 : 25e9;
        if (i % 4 == 1) costs[i].maxSamples = B / n + 1;
      }
      auto time = [&](auto&& fn) {
        std::vector<double> us;
        for (int rep = 0; rep < 200; ++rep) {
          auto t0 = std::chrono::steady_clock::now();
          fn();
          us.push_back(
              std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                  .count());
        }
        std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
        return us[us.size() / 2];
      };
      volatile int64_t sink = 0;
      const double solve = time([&] { sink = sink + hddp::solveSplit(costs, B).local[0]; });
      const double equal = time([&] { sink = sink + hddp::equalSplit(n, B).local[0]; });
      std::printf("%6d %7lld %14.1f %14.1f\n", n, static_cast<long long>(B), solve, equal);
    }
  }
  return 0;
}
