// Elastic membership (docs/elastic.md): hddp-run --nproc-per-node MIN:MAX, a rank that
// is unplugged and comes back, commits, and state saved by N ranks loaded into M.
#include "train/elastic.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "support/ranks.h"

namespace {

using hddp::testing::runCommand;

std::string launcher() { return hddp::testing::toolsDir() + "/hddp-run"; }
std::string worker() { return HDDP_TEST_WORKER; }

// Each step's samples (all ranks together, sorted) from the HDDP_LOG_SAMPLES files of a
// run, taking each step from the last generation that trained it: a step trained after
// the newest commit and lost with a rank is trained again by the next generation, and
// only that one counts. `repeated` receives how many steps were trained twice.
std::map<int64_t, std::vector<int64_t>> stepsOf(const std::string& prefix, int* repeated) {
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

std::vector<at::Tensor> loadParams(const std::string& path) {
  std::vector<at::Tensor> out;
  torch::load(out, path);
  return out;
}

}  // namespace

TEST(Elastic, CommitIntervalKeepsTheCommitUnderTwoPercentOfTheSteps) {
  EXPECT_EQ(hddp::train::commitInterval(0.010, 0.050), 10);  // 10 ms against 2% of 50 ms
  EXPECT_EQ(hddp::train::commitInterval(0.0111, 0.050), 12);
  EXPECT_EQ(hddp::train::commitInterval(0.0, 0.050), 1);
  EXPECT_EQ(hddp::train::commitInterval(100.0, 0.001), 10000);  // at most 10000
  EXPECT_EQ(hddp::train::commitInterval(0.01, 0.0), 10);        // nothing measured yet
}

TEST(Elastic, UsageErrorsSayWhatToGive) {
  struct Case {
    std::string args;
    std::string says;
  };
  for (const Case& c : std::vector<Case>{
           {"--nproc-per-node 3:2", "MIN is above MAX"},
           {"--nproc-per-node two", "not a rank count"},
           {"--nproc-per-node 2:x", "not a rank count"},
           {"--nproc-per-node 2 --emulate-unplug 1@3", "need an elastic job"},
           {"--nproc-per-node 2:3 --emulate-unplug 3@1", "there is no slot 3"},
           {"--nproc-per-node 2:3 --emulate-unplug 1@5:4", "is not SLOT@SECONDS[:BACK]"},
           {"--nproc-per-node 2:3 --nnodes 2 --master-addr 10.0.0.1 --master-port 29500",
            "one node for now"},
       }) {
    auto r = runCommand(launcher() + " " + c.args + " -- " + worker() + " allreduce");
    EXPECT_EQ(r.exitCode, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.args << "\n" << r.output;
  }
}

TEST(Elastic, ARankUnpluggedAndBackLosesNoSampleAndEndsAsAnUndisturbedRun) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::string elastic = dir + "/elastic";
  const std::string straight = dir + "/straight";
  std::filesystem::create_directories(elastic);
  std::filesystem::create_directories(straight);
  // Unplugged at a random moment of the first generation's training, back 1.5 s later.
  std::mt19937 gen(std::random_device{}());
  const double at = std::uniform_real_distribution<double>(1.5, 3.0)(gen);
  char unplug[64];
  std::snprintf(unplug, sizeof(unplug), "2@%.2f:%.2f", at, at + 1.5);
  SCOPED_TRACE(std::string("--emulate-unplug ") + unplug);
  auto r = runCommand("HDDP_LOG_LEVEL=info HDDP_LOG_SAMPLES=" + elastic + "/samples " + launcher() +
                      " --nproc-per-node 2:3 --rejoin-every 0.25 --emulate-unplug " + unplug +
                      " -- " + worker() + " elastic-train " + elastic);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("unplugging slot 2 (rank 2)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("generation 1: 2 rank(s) on slots 0,1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("slot(s) 2 can run again"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("generation 2: 3 rank(s) on slots 0,1,2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("trained 150 steps"), std::string::npos) << r.output;
  auto s = runCommand("HDDP_LOG_SAMPLES=" + straight + "/samples " + launcher() +
                      " --nproc-per-node 3 -- " + worker() + " elastic-train " + straight);
  ASSERT_EQ(s.exitCode, 0) << s.output;

  int repeated = 0;
  int none = 0;
  const auto trained = stepsOf(elastic + "/samples", &repeated);
  const auto reference = stepsOf(straight + "/samples", &none);
  EXPECT_EQ(none, 0);
  ASSERT_EQ(trained.size(), 150u);
  ASSERT_EQ(reference.size(), 150u);
  for (int64_t epoch = 0; epoch < 5; ++epoch) {  // 30 steps of 24 = the 720 samples once
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
  std::printf("unplugged at %.2f s; %d step(s) trained again after the loss\n", at, repeated);
  // The log says how many, from the last step each slot marked before it was stopped.
  // A mark is written just after the step's sample line, so a rank killed between the
  // two (while the others are being stopped) leaves the log one step short.
  int logged = -1;
  const size_t count = r.output.find(" steps)");
  if (r.output.find("no step is trained again") != std::string::npos &&
      count == std::string::npos) {
    logged = 0;
  } else if (count != std::string::npos) {
    const size_t open = r.output.rfind('(', count);
    logged = std::atoi(r.output.c_str() + open + 1);
  }
  EXPECT_GE(logged, repeated - 1) << r.output;
  EXPECT_LE(logged, repeated) << r.output;
  const auto a = loadParams(elastic + "/final.pt");
  const auto b = loadParams(straight + "/final.pt");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::allclose(a[i], b[i], /*rtol=*/1e-4, /*atol=*/1e-5))
        << "tensor " << i << " differs by " << (a[i] - b[i]).abs().max().item<double>();
  }
}

TEST(Elastic, BelowItsMinimumTheJobEndsAtOnceNamingTheRank) {
  const std::string dir = hddp::testing::makeTempDir();
  auto r = runCommand(launcher() + " --nproc-per-node 3:3 --emulate-unplug 1@1.5 -- " + worker() +
                      " elastic-train " + dir);
  EXPECT_EQ(r.exitCode, 1) << r.output;
  EXPECT_NE(r.output.find("fewer than the minimum 3; slot 1: rank 1 was killed by signal 9"),
            std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 30.0) << r.output;
}
