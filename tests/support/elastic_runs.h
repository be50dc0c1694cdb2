// Elastic jobs in tests (tests/comm/elastic*_test.cpp): the job record as hddp-probe
// reads it, and each step's samples from the HDDP_LOG_SAMPLES files of a run.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "support/ranks.h"

namespace hddp {
namespace testing {

inline std::string probe() { return toolsDir() + "/../hddp-probe/hddp-probe"; }

// `hddp-probe --job DIR --json`, parsed.
inline nlohmann::json probeJob(const std::string& dir) {
  auto r = runCommand(probe() + " --job " + dir + " --json");
  EXPECT_EQ(r.exitCode, 0) << r.output;
  const size_t start = r.output.find('{');
  return start == std::string::npos ? nlohmann::json()
                                    : nlohmann::json::parse(r.output.substr(start), nullptr,
                                                            /*allow_exceptions=*/false);
}

// Each step's samples (all ranks together, sorted) from the HDDP_LOG_SAMPLES files of a
// run, taking each step from the last generation that trained it: a step trained after
// the newest commit and lost with a rank is trained again by the next generation, and
// only that one counts. `repeated` receives how many steps were trained twice.
inline std::map<int64_t, std::vector<int64_t>> stepsOf(const std::string& prefix, int* repeated) {
  std::map<int64_t, std::pair<int, std::vector<int64_t>>> steps;  // step -> generation, samples
  std::map<int64_t, std::set<int>> generations;
  for (int rank = 0; rank < 8; ++rank) {
    std::ifstream in(prefix + ".rank" + std::to_string(rank));
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      int generation = 0;
      int64_t step = 0;
      int r = 0;
      fields >> generation >> step >> r;
      generations[step].insert(generation);
      auto& entry = steps[step];
      if (generation > entry.first || entry.second.empty()) {
        if (generation > entry.first) {
          entry.second.clear();
        }
        entry.first = generation;
      }
      if (generation == entry.first) {
        for (int64_t i; fields >> i;) {
          entry.second.push_back(i);
        }
      }
    }
  }
  *repeated = 0;
  for (const auto& g : generations) {
    *repeated += g.second.size() > 1 ? 1 : 0;
  }
  std::map<int64_t, std::vector<int64_t>> out;
  for (auto& [step, entry] : steps) {
    std::sort(entry.second.begin(), entry.second.end());
    out[step] = entry.second;
  }
  return out;
}

// The test worker's elastic-train run (5 epochs of 30 steps of 24 samples): every step
// trained the reference run's samples, and each epoch trained the 720 samples once.
inline void expectEachEpochOnceAsTheReference(
    const std::map<int64_t, std::vector<int64_t>>& trained,
    const std::map<int64_t, std::vector<int64_t>>& reference) {
  for (int64_t epoch = 0; epoch < 5; ++epoch) {
    std::vector<int64_t> all;
    for (int64_t step = epoch * 30 + 1; step <= (epoch + 1) * 30; ++step) {
      ASSERT_EQ(trained.at(step), reference.at(step)) << "step " << step;
      all.insert(all.end(), trained.at(step).begin(), trained.at(step).end());
    }
    std::sort(all.begin(), all.end());
    std::vector<int64_t> once(720);
    std::iota(once.begin(), once.end(), 0);
    EXPECT_EQ(all, once) << "epoch " << epoch;
  }
}

}  // namespace testing
}  // namespace hddp
