// The Trainer's planner at work: an emulated slow rank gets less (every rank deriving
// the same plan), a rank sixty times slower gets a few samples and the result stays that
// of one device, and an out-of-memory rank teaches its cap and repeats the step (or,
// without balancing, the error says what to do).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "hddp/balance/batch_plan.h"
#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/data/datasets.h"
#include "hddp/train/trainer.h"
#include "support/ranks.h"
#include "support/trainer_runs.h"
#include "support/virtual_time.h"

using hddp::testing::Net;
using hddp::testing::runThreads;
using hddp::testing::trainRun;

// Rank 1 emulated 4x slower, on virtual clocks (support/virtual_time.h): the model's
// forward costs 0.3 ms a sample on each rank's clock, rank 1's emulator stretches that by
// 4 (its sleeps advance the clock), and the planner learns exactly those costs, however
// slow or loaded the machine: its split is the solver's for them, [26, 6] of 32.
TEST(Trainer, PlannerGivesTheEmulatedSlowRankLess) {
  constexpr double kSecondsPerSample = 3e-4;
  std::vector<std::vector<int64_t>> plans(2);
  const std::string dir = hddp::testing::makeTempDir();
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net model;
    torch::optim::SGD opt(model->parameters(), 0.01);
    hddp::TrainerOptions o;
    o.globalBatch = 32;
    o.maxSteps = 12;
    o.progress = hddp::ProgressMode::Off;
    o.planner.rebalanceEvery = 3;
    o.timelinePath = dir + "/timeline.json";
    o.metricsPath = dir + "/m.jsonl";
    hddp::EmulationOptions slow;
    slow.slowdown = rank == 1 ? 4.0 : 1.0;
    o.emulation = slow;
    auto clock = std::make_shared<hddp::testing::VirtualClock>();
    hddp::testing::measureOn(clock, o);
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(640, 1, 8, 4);
    auto forward = [&model, clock](const at::Tensor& x) {
      clock->advance(kSecondsPerSample * static_cast<double>(x.size(0)));
      return model->forward(x);
    };
    hddp::Trainer trainer(*comm, model.ptr(), forward, hddp::crossEntropy(), opt, ds, o);
    trainer.fit();
    plans[rank] = trainer.planner()->plan().local;
  });
  std::vector<hddp::RankCost> costs(2);
  costs[0].secondsPerSample = kSecondsPerSample;
  costs[1].secondsPerSample = 4 * kSecondsPerSample;
  const auto expected = hddp::solveSplit(costs, 32).local;
  ASSERT_EQ(expected, (std::vector<int64_t>{26, 6}));
  EXPECT_EQ(plans[0], expected) << "plan [" << plans[0][0] << ", " << plans[0][1] << "]";
  EXPECT_EQ(plans[1], plans[0]);  // every rank derived the same plan
  // What each rank handed the planner, step by step: its compute, stretched by 4 on
  // rank 1 from its first step on (there being no estimate before it, the step is
  // stretched by what it measured), so the calibration sees its emulated speed; the
  // extra time is in the record as emulated_s, on rank 1 only.
  for (int rank : {0, 1}) {
    std::ifstream in(dir + (rank == 0 ? "/m.jsonl" : "/m.rank1.jsonl"));
    int steps = 0;
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.value("kind", "") != "step") {
        continue;
      }
      ++steps;
      const auto b = static_cast<double>(j.at("local_batch").get<int64_t>());
      const double slowdown = rank == 1 ? 4.0 : 1.0;
      EXPECT_NEAR(j.at("compute_s").get<double>(), slowdown * kSecondsPerSample * b, 1e-9)
          << "rank " << rank << ": " << line;
      EXPECT_NEAR(j.value("emulated_s", 0.0), (slowdown - 1) * kSecondsPerSample * b, 1e-9)
          << "rank " << rank << ": " << line;
    }
    EXPECT_EQ(steps, 12) << "rank " << rank;
  }
  // The planner's allgathers (after the 3 calibration steps, then every 3) are on the
  // communication track of the timeline, for every rank; rank 1's emulator measured its
  // first step (step 0), rank 0 has no emulator at work.
  std::ifstream in(dir + "/timeline.json");
  auto trace = nlohmann::json::parse(in);
  std::map<int, int> exchanges;
  std::map<int, int> firstStepEmulated;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "X" && e.at("name") == "plan exchange") {
      ++exchanges[e.at("pid").get<int>()];
    }
    if (e.at("ph") == "X" && e.at("name") == "emulated delay" && e.at("args").at("step") == 0) {
      ++firstStepEmulated[e.at("pid").get<int>()];
    }
  }
  EXPECT_EQ(exchanges, (std::map<int, int>{{0, 4}, {1, 4}}));
  EXPECT_EQ(firstStepEmulated, (std::map<int, int>{{1, 1}}));
}

// A rank 60 times slower than the other (a CPU rank next to a GPU): the planner gives it
// a few samples or none, every global batch is still trained whole, and the result is
// that of one device training on the whole batches.
TEST(Trainer, ARankSixtyTimesSlowerGetsAFewSamplesAndTheResultStaysExact) {
  auto train = [](int size, double slowdown, std::vector<int64_t>* plan) {
    std::vector<at::Tensor> params;
    runThreads(size, [&](int rank, int n, hddp::Store& store) {
      auto comm = hddp::makeCommunicator(store, rank, n);
      torch::nn::Sequential model{nullptr};
      {
        static std::mutex seeding;  // the ranks are threads sharing one generator
        std::lock_guard<std::mutex> lock(seeding);
        torch::manual_seed(5);
        model = torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(64, 16),
                                      torch::nn::ReLU(), torch::nn::Linear(16, 4));
      }
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      hddp::TrainerOptions o;
      o.globalBatch = 64;
      o.epochs = 3;
      o.maxSteps = 24;
      o.progress = hddp::ProgressMode::Off;
      o.planner.calibrationSteps = 2;
      o.planner.rebalanceEvery = 4;
      hddp::EmulationOptions slow;
      slow.slowdown = rank == 1 ? slowdown : 1.0;
      o.emulation = slow;
      auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(640, 1, 8, 4, 3);
      // 0.2 ms per sample (a sleep), so that compute grows with the batch on shared cores.
      auto forward = [&model](const at::Tensor& x) {
        std::this_thread::sleep_for(std::chrono::microseconds(200 * x.size(0)));
        return model->forward(x);
      };
      hddp::Trainer trainer(*comm, model.ptr(), forward, hddp::crossEntropy(), opt, ds, o);
      const auto summary = trainer.fit();
      EXPECT_EQ(summary.steps, 24);
      if (rank == 0) {
        for (const auto& p : model->parameters()) {
          params.push_back(p.detach().clone());
        }
        if (plan) {
          *plan = trainer.planner()->plan().local;
        }
      }
    });
    return params;
  };
  std::vector<int64_t> plan;
  const auto split = train(2, 60.0, &plan);
  const auto single = train(1, 1.0, nullptr);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0] + plan[1], 64);
  EXPECT_LE(plan[1], 3) << "plan [" << plan[0] << ", " << plan[1] << "]";
  ASSERT_EQ(split.size(), single.size());
  for (size_t i = 0; i < split.size(); ++i) {
    EXPECT_LT((split[i] - single[i]).abs().max().item<double>(), 1e-5)
        << "parameter " << i << ": " << (split[i] - single[i]).abs().max().item<double>();
  }
}

// Rank 1 "runs out of memory" above 20 samples (emulated: c10::OutOfMemoryError in
// forward). Every rank abandons those steps together, rank 1's cap is learned, the
// same samples are trained again under the new split, and the cap is kept in the state.
TEST(Trainer, OutOfMemoryTeachesTheCapAndRepeatsTheStepWithoutLosingSamples) {
  const std::string dir = hddp::testing::makeTempDir();
  std::vector<hddp::TrainSummary> summaries(2);
  std::vector<std::vector<int64_t>> caps(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net model;
    torch::optim::SGD opt(model->parameters(), 0.05);
    hddp::TrainerOptions o;
    o.globalBatch = 64;
    o.epochs = 1;
    o.progress = hddp::ProgressMode::Off;
    o.metricsPath = dir + "/metrics.jsonl";
    o.saveDir = dir + "/state";
    o.seedPlan = false;  // start from the equal split, above rank 1's memory
    hddp::EmulationOptions e;
    e.memoryCapSamples = rank == 1 ? 20 : 0;
    o.emulation = e;
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(600, 1, 8, 4);
    hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt, ds,
                          o);
    summaries[rank] = trainer.fit();
    hddp::Trainer resumed(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt, ds,
                          o);
    resumed.load(o.saveDir);
    caps[rank] = resumed.planner()->memoryCaps();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_GE(summaries[r].repeatedSteps, 1) << "rank " << r;
    EXPECT_EQ(summaries[r].steps, 10) << "rank " << r << ": 600 samples in steps of 64";
    ASSERT_EQ(caps[r].size(), 2u);
    EXPECT_LE(caps[r][1], 20) << "rank " << r;
    EXPECT_GE(caps[r][1], 17) << "rank " << r << ": learned 10% steps below the failing size";
    EXPECT_EQ(caps[r][0], std::numeric_limits<int64_t>::max());
  }
  // Every sample trained exactly once: the steps' shares add up to the dataset, and
  // no completed step gave rank 1 more than its cap.
  int64_t trained = 0;
  int outOfMemoryRecords = 0;
  for (const char* name : {"metrics.jsonl", "metrics.rank1.jsonl"}) {
    std::ifstream in(dir + "/" + name);
    ASSERT_TRUE(in.good()) << name;
    std::string line;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line);
      if (j.at("kind") == "step") {
        trained += j.at("local_batch").get<int64_t>();
        EXPECT_LE(j.at("plan")[1].get<int64_t>(), 20) << line;
      } else if (j.at("kind") == "out_of_memory") {
        ++outOfMemoryRecords;
        EXPECT_EQ(j.at("failed")[0].at("rank"), 1) << line;
      }
    }
  }
  EXPECT_EQ(trained, 600);
  EXPECT_EQ(outOfMemoryRecords, 2 * summaries[0].repeatedSteps);
}

// With the equal split an out-of-memory rank cannot get fewer samples: the error says
// what to do, on every rank, and nobody hangs.
TEST(Trainer, OutOfMemoryWithoutBalancingSaysWhatToDo) {
  std::vector<std::string> errors(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    try {
      trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
        hddp::EmulationOptions e;
        e.memoryCapSamples = rank == 1 ? 8 : 0;
        o.emulation = e;
      });
    } catch (const hddp::Error& e) {
      errors[rank] = e.what_without_backtrace();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank 1 ran out of memory with its equal share of 12"),
              std::string::npos)
        << errors[r];
    EXPECT_NE(errors[r].find("turn balancing on"), std::string::npos) << errors[r];
  }
}
