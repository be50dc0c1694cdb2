// --compress auto on two CPU ranks over an emulated link: which compression it takes
// for the link's speed, what it predicts the allreduce takes, and that the choice goes
// into state files (split from step_timing_test.cpp).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/data/datasets.h"
#include "hddp/train/trainer.h"
#include "support/ranks.h"

using hddp::testing::runThreads;

namespace {

struct AutoRun {
  std::string chosen;          // the metrics' config
  bool powerSgdState = false;  // DDP built with PowerSGD
  int64_t powerSgdSteps = 0;   // its step count at the end
  std::vector<double> waits;   // rank 0's comm_wait_s from step 3 on
  double predicted = 0.0;      // allreduce_predicted_s
};

// Two ranks of a 64 -> 4096 linear layer (1.05 MB of gradients in one bucket, so the
// allreduce cannot hide; a forward of 0.5 ms a sample, so backward is ~4 ms of the local
// batch of 4) under --compress auto, over an emulated link of `link` bytes/s.
AutoRun runAuto(double link, const std::string& saveDir = "", int64_t maxSteps = 12) {
  const std::string dir = hddp::testing::makeTempDir();
  AutoRun out;
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    torch::manual_seed(7);
    at::set_num_threads(1);
    torch::nn::Linear model(64, 4096);
    torch::optim::SGD opt(model->parameters(), 0.01);
    hddp::TrainerOptions o;
    o.globalBatch = 8;
    o.maxSteps = maxSteps;
    o.progress = hddp::ProgressMode::Off;
    o.loader.workers = 1;
    o.metricsPath = dir + "/m.jsonl";
    o.saveDir = saveDir;
    o.saveEvery = saveDir.empty() ? 0 : 3;
    o.resume = saveDir;
    o.ddp.compression = hddp::GradCompression::Auto;
    o.ddp.powerSgd.startStep = 2;
    hddp::EmulationOptions e;
    e.linkBytesPerSecond = link;
    e.collectiveBytesPerSecond = link;
    o.emulation = e;
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(8 * 12, 1, 8, 4096);
    hddp::Trainer trainer(
        *comm, model.ptr(),
        [model](const at::Tensor& x) mutable {
          // 0.5 ms a sample (a sleep: the ranks share two cores): a backward to hide behind.
          std::this_thread::sleep_for(std::chrono::microseconds(500 * x.size(0)));
          return model->forward(x.flatten(1));
        },
        hddp::crossEntropy(), opt, ds, o);
    trainer.fit();
    if (rank == 0) {
      const auto& state = trainer.ddp().powerSgdState();
      out.powerSgdState = state != nullptr;
      out.powerSgdSteps = state ? state->step() : 0;
    }
  });
  std::ifstream in(dir + "/m.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("kind", "") == "config") {
      out.chosen = j.value("compression", "");
    } else if (j.value("kind", "") == "step" && j.value("step", 0) >= 3) {
      out.waits.push_back(j.at("comm_wait_s").get<double>());
      out.predicted = j.value("allreduce_predicted_s", 0.0);
    }
  }
  return out;
}

}  // namespace

// --compress auto prices the choices over the job's slowest link against the backward
// they can hide behind: on a link where the plain allreduce (1.05 MB at 2 MB/s: 525 ms)
// dwarfs backward it takes PowerSGD, whose allreduce the Trainer predicts from the bytes
// it sends; on a link that carries the gradients in well under backward it keeps the
// plain allreduce. The measured wait is bounded from below by the prediction (a loaded
// machine only lengthens a wait for an emulated passage) and from above by a quarter of
// the plain allreduce's time (what crossed the link was PowerSGD's bytes). How close
// wait and prediction are is a speed: bench/compress_compare.py records both.
TEST(StepTiming, CompressAutoTakesPowerSgdOnASlowLinkAndWaitsForItsBytes) {
  AutoRun slow = runAuto(2e6);
  EXPECT_EQ(slow.chosen.rfind("powersgd:", 0), 0u) << slow.chosen;
  EXPECT_TRUE(slow.powerSgdState);
  ASSERT_GE(slow.waits.size(), 8u);
  std::sort(slow.waits.begin(), slow.waits.end());
  const double median = slow.waits[slow.waits.size() / 2];
  std::printf("auto over 2 MB/s: %s, median comm_wait_s %.1f ms, predicted %.1f ms (%.2fx)\n",
              slow.chosen.c_str(), median * 1e3, slow.predicted * 1e3,
              median / std::max(slow.predicted, 1e-9));
  // The compressed bytes (rank 1: 33 kB; rank 4: 83 kB) and DDP's status, not 1.05 MB.
  const double plainSeconds = 1.05e6 / 2e6;
  EXPECT_GT(slow.predicted, 0.0);
  EXPECT_LT(slow.predicted, 0.1 * plainSeconds);
  EXPECT_GE(median, 0.75 * slow.predicted - 2e-3);
  EXPECT_LT(median, 0.25 * plainSeconds);

  const AutoRun fast = runAuto(10e9);
  EXPECT_EQ(fast.chosen, "none");
  EXPECT_FALSE(fast.powerSgdState);
}

// The choice goes into state files: a run resumed under --compress auto goes on with the
// file's choice and PowerSGD's state (its step count, its memories), even where auto
// would now choose otherwise (here: a fast link that would keep the plain allreduce).
TEST(StepTiming, CompressAutoResumesWithTheChoiceItsStateFileWasTrainedWith) {
  const std::string saveDir = hddp::testing::makeTempDir();
  const AutoRun first = runAuto(2e6, saveDir, 6);
  ASSERT_EQ(first.chosen.rfind("powersgd:", 0), 0u) << first.chosen;
  ASSERT_EQ(first.powerSgdSteps, 6);
  const AutoRun resumed = runAuto(10e9, saveDir, 12);
  EXPECT_EQ(resumed.chosen, first.chosen);
  EXPECT_TRUE(resumed.powerSgdState);
  EXPECT_EQ(resumed.powerSgdSteps, 12) << "the saved step count goes on";
  // allreduce_predicted_s follows what is sent: PowerSGD's bytes, not the plain 1.05 MB.
  EXPECT_GT(resumed.predicted, 0.0);
  EXPECT_LT(resumed.predicted, 0.1 * 1.05e6 / 10e9);
  // Without a state file the same fast link keeps the plain allreduce.
  EXPECT_EQ(runAuto(10e9, hddp::testing::makeTempDir(), 3).chosen, "none");
}
