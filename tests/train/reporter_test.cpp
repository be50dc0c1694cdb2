// What the Reporter writes for a run that --max-steps ends early: the progress lines
// count to the run's last step, not to the epoch's, and the summary record has no
// training loss (null) when no epoch completed, instead of a loss of 0.
#include "train/reporter.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "hddp/train/part.h"
#include "support/disk.h"
#include "support/ranks.h"

namespace {

// The progress lines (rank 0, plain lines every `logEvery` steps) of `steps` steps of
// an epoch of `stepsPerEpoch`, starting at global step `firstStep` (1-based) in `epoch`.
std::string progressOf(int64_t epoch, int64_t epochs, int64_t firstStep, int64_t steps,
                       int64_t stepsPerEpoch, int64_t maxSteps, int64_t logEvery) {
  ::testing::internal::CaptureStderr();
  {
    hddp::train::Reporter reporter("", 0, /*append=*/false, /*showProgress=*/true,
                                   /*live=*/false, logEvery);
    for (int64_t i = 0; i < steps; ++i) {
      hddp::train::StepReport r;
      r.epoch = epoch;
      r.epochs = epochs;
      r.step = firstStep + i;
      r.stepInEpoch = (firstStep + i - 1) % stepsPerEpoch;
      r.stepsPerEpoch = stepsPerEpoch;
      r.maxSteps = maxSteps;
      r.globalBatch = 128;
      r.localBatch = 128;
      r.plan = {128};
      r.loss = 1.0;
      r.stepSeconds = 0.1;
      reporter.step(r);
    }
  }
  return ::testing::internal::GetCapturedStderr();
}

std::vector<nlohmann::json> recordsIn(const std::string& path) {
  std::vector<nlohmann::json> records;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) {
      records.push_back(nlohmann::json::parse(line));
    }
  }
  return records;
}

}  // namespace

// 469 steps an epoch (Fashion-MNIST in batches of 128) under maxSteps 60: "step 25/60".
TEST(Reporter, ProgressCountsToMaxStepsWhenItEndsTheRunFirst) {
  std::string out = progressOf(0, 1, 1, 60, 469, 60, 25);
  EXPECT_NE(out.find("epoch 1/1 step 25/60 "), std::string::npos) << out;
  EXPECT_NE(out.find("epoch 1/1 step 60/60 "), std::string::npos) << out;  // the last line
  EXPECT_EQ(out.find("/469"), std::string::npos) << out;
  // 5 epochs asked, maxSteps 600 ends the run in the second: "epoch 2/2", 131 steps there.
  out = progressOf(1, 5, 470, 131, 469, 600, 25);
  EXPECT_NE(out.find("epoch 2/2 step 25/131 "), std::string::npos) << out;
  EXPECT_NE(out.find("epoch 2/2 step 131/131 "), std::string::npos) << out;
  out = progressOf(0, 5, 1, 25, 469, 600, 25);
  EXPECT_NE(out.find("epoch 1/2 step 25/469 "), std::string::npos) << out;
  // Without maxSteps, or with one past the run's end, the epoch's own count.
  for (const int64_t maxSteps : {0, 5000}) {
    out = progressOf(0, 2, 1, 25, 469, maxSteps, 25);
    EXPECT_NE(out.find("epoch 1/2 step 25/469 "), std::string::npos) << maxSteps << "\n" << out;
  }
}

TEST(Reporter, SummaryHasNoTrainingLossWhenNoEpochCompleted) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::string path = dir + "/metrics.jsonl";
  {
    hddp::train::Reporter reporter(path, 0, /*append=*/false, /*showProgress=*/false,
                                   /*live=*/false, 20);
    hddp::TrainSummary s;
    s.steps = 4;
    s.totalSteps = 4;
    s.epochsCompleted = 0;  // maxSteps 4 inside the first epoch
    reporter.summary(s, {});
    s.epochsCompleted = 1;
    s.lastTrainLoss = 0.75;
    reporter.summary(s, {});
  }
  const auto records = recordsIn(path);
  ASSERT_EQ(records.size(), 2u);
  ASSERT_TRUE(records[0].contains("train_loss")) << records[0];
  EXPECT_TRUE(records[0]["train_loss"].is_null()) << records[0];
  EXPECT_DOUBLE_EQ(records[1]["train_loss"].get<double>(), 0.75) << records[1];
  hddp::testing::removeTree(dir);
}
