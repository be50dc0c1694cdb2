// The trainers' flags as a user meets them (#52): --export into several files, the
// summary of a run that --max-steps ends inside its first epoch, --log-every, --stem
// with a torchvision-shaped state dict, and the error a user reads (one prefix, no
// source locations; those stay in the debug log).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "example_common.h"
#include "hddp/train/state_dict.h"
#include "support/disk.h"
#include "support/ranks.h"

namespace {

const std::string kResnet = HDDP_TEST_TRAIN_RESNET;
const std::string kTiny =
    "--model resnet20 --dataset synthetic --image-size 16 --limit-train 96 --limit-test 32 "
    "--global-batch 16 --epochs 1 --workers 0 --threads 1 --no-augment";
// ResNet-18 on 3-channel 16 px images: small enough for a few CPU steps.
const std::string kTinyResnet18 =
    "--model resnet18 --dataset synthetic --channels 3 --image-size 16 --limit-train 32 "
    "--limit-test 16 --global-batch 16 --epochs 1 --workers 0 --threads 1 --no-augment "
    "--progress off";

struct Run {
  int status = -1;
  std::string output;
  std::vector<nlohmann::json> records;
};

// `args` on one CPU rank, with its metrics file in `dir`; `env` before the command.
Run runResnet(const std::string& dir, const std::string& args, const std::string& env = "") {
  const std::string metrics = dir + "/metrics.jsonl";
  const auto r = hddp::testing::runCommand(env + " " + kResnet + " " + args + " --metrics " +
                                           metrics + " 2>&1");
  Run run;
  run.status = r.exitCode;
  run.output = r.output;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) {
      run.records.push_back(nlohmann::json::parse(line));
    }
  }
  std::remove(metrics.c_str());
  return run;
}

std::vector<nlohmann::json> ofKind(const Run& r, const std::string& kind) {
  std::vector<nlohmann::json> out;
  for (const auto& rec : r.records) {
    if (rec.value("kind", "") == kind) {
      out.push_back(rec);
    }
  }
  return out;
}

}  // namespace

// Repeated and comma-separated: every file written, each the same state dict.
TEST(ExampleTrainerFlags, ExportWritesEveryFileGiven) {
  const std::string dir = hddp::testing::makeTempDir();
  const auto r = runResnet(dir, kTiny + " --max-steps 1 --export " + dir + "/a.pt," + dir +
                                    "/b.safetensors --export " + dir + "/c.pt");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto a = hddp::readStateDict(dir + "/a.pt");
  ASSERT_FALSE(a.empty());
  for (const char* other : {"/b.safetensors", "/c.pt"}) {
    const auto b = hddp::readStateDict(dir + other);
    ASSERT_EQ(b.size(), a.size()) << other;
    for (const auto& [key, tensor] : a) {
      ASSERT_TRUE(b.count(key)) << other << " lacks " << key;
      EXPECT_TRUE(b.at(key).equal(tensor)) << other << ": " << key;
    }
  }
  hddp::testing::removeTree(dir);
}

// 6 steps an epoch, --max-steps 2: the summary has no training loss (null), not 0.
TEST(ExampleTrainerFlags, SummaryHasNoTrainingLossWhenMaxStepsEndsTheFirstEpoch) {
  const std::string dir = hddp::testing::makeTempDir();
  auto r = runResnet(dir, kTiny + " --max-steps 2 --progress off");
  ASSERT_EQ(r.status, 0) << r.output;
  auto summary = ofKind(r, "summary");
  ASSERT_EQ(summary.size(), 1u) << r.output;
  EXPECT_EQ(summary[0]["epochs_completed"].get<int64_t>(), 0);
  ASSERT_TRUE(summary[0].contains("train_loss")) << summary[0];
  EXPECT_TRUE(summary[0]["train_loss"].is_null()) << summary[0];
  // A completed epoch: its mean loss, as the epoch record has it.
  r = runResnet(dir, kTiny + " --progress off");
  ASSERT_EQ(r.status, 0) << r.output;
  summary = ofKind(r, "summary");
  const auto epochs = ofKind(r, "epoch");
  ASSERT_EQ(summary.size(), 1u) << r.output;
  ASSERT_EQ(epochs.size(), 1u) << r.output;
  EXPECT_DOUBLE_EQ(summary[0]["train_loss"].get<double>(), epochs[0]["train_loss"].get<double>());
  hddp::testing::removeTree(dir);
}

// --log-every thins the progress lines; the metrics file has every step, as the help says.
TEST(ExampleTrainerFlags, LogEveryThinsTheProgressLinesAndTheMetricsHaveEveryStep) {
  const std::string dir = hddp::testing::makeTempDir();
  const auto r = runResnet(dir, kTiny + " --log-every 4 --progress lines");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(ofKind(r, "step").size(), 6u) << r.output;
  EXPECT_NE(r.output.find("step 4/6 "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 6/6 "), std::string::npos) << r.output;  // the epoch's last
  for (const char* thinned : {"step 1/6 ", "step 2/6 ", "step 3/6 ", "step 5/6 "}) {
    EXPECT_EQ(r.output.find(thinned), std::string::npos) << thinned << "\n" << r.output;
  }
  const auto help = hddp::testing::runCommand(kResnet + " --help 2>&1");
  const auto at = help.output.find("--log-every");
  ASSERT_NE(at, std::string::npos) << help.output;
  const std::string entry = help.output.substr(at, help.output.find("--progress", at) - at);
  EXPECT_NE(entry.find("record of every step"), std::string::npos) << entry;
  EXPECT_EQ(entry.find("metrics every"), std::string::npos) << entry;
  hddp::testing::removeTree(dir);
}

// The progress lines count to the step where --max-steps ends the run, not the epoch's.
TEST(ExampleTrainerFlags, ProgressCountsToMaxStepsWhenItEndsTheRunInsideTheEpoch) {
  const std::string dir = hddp::testing::makeTempDir();
  const auto r = runResnet(dir, kTiny + " --max-steps 4 --log-every 1 --progress lines");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(ofKind(r, "step").size(), 4u) << r.output;
  EXPECT_NE(r.output.find("step 4/4 "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("/6 "), std::string::npos) << r.output;  // the epoch has 6 steps
  hddp::testing::removeTree(dir);
}

// A state dict with torchvision's stem (7x7/2 conv1 and max-pool, 3 channels) into the
// CIFAR stem of 16 px images: the error says both fixes, once, without "hddp: hddp:" or
// "[state_dict.cpp:257]" (which stay in the debug log); --stem torchvision loads it and
// exports it back.
TEST(ExampleTrainerFlags, TorchvisionStemLoadsWithStemTorchvisionAndTheErrorSaysTheFix) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::string tv = dir + "/tv.safetensors";
  auto r = runResnet(dir, kTinyResnet18 + " --stem torchvision --max-steps 1 --export " + tv);
  ASSERT_EQ(r.status, 0) << r.output;
  ASSERT_EQ(hddp::readStateDict(tv).at("conv1.weight").sizes(),
            (std::vector<int64_t>{64, 3, 7, 7}));

  // The CIFAR stem (auto at 16 px) with 1 channel: both fixes, with its channel count.
  r = runResnet(dir, kTinyResnet18 + " --channels 1 --init-from " + tv);
  EXPECT_EQ(r.status, 2) << r.output;
  const std::string advice =
      "`model.conv1 = torch.nn.Conv2d(1, 64, 3, 1, 1, bias=False); model.maxpool = "
      "torch.nn.Identity()`";
  EXPECT_NE(r.output.find(advice), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--stem torchvision (and --channels 3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("train_resnet: configuration error: state dict "), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("hddp:"), std::string::npos) << r.output;
  const std::regex location(R"(\[[a-z_]+\.(cpp|h):[0-9]+\])");
  EXPECT_FALSE(std::regex_search(r.output, location)) << r.output;
  // The debug log keeps where it came from.
  r = runResnet(dir, kTinyResnet18 + " --channels 1 --init-from " + tv, "HDDP_LOG_LEVEL=debug");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("[state_dict.cpp:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[model_files.cpp:"), std::string::npos) << r.output;

  // --stem torchvision: loads, trains a step and exports torchvision's shapes back.
  const std::string back = dir + "/back.pt";
  r = runResnet(dir, kTinyResnet18 + " --stem torchvision --max-steps 1 --init-from " + tv +
                         " --export " + back);
  ASSERT_EQ(r.status, 0) << r.output;
  const auto in = hddp::readStateDict(tv);
  const auto out = hddp::readStateDict(back);
  ASSERT_EQ(out.size(), in.size());
  for (const auto& [key, tensor] : in) {
    ASSERT_TRUE(out.count(key)) << key;
    EXPECT_EQ(out.at(key).sizes(), tensor.sizes()) << key;
  }
  // A model without the torchvision structure refuses the stem.
  r = runResnet(dir, kTiny + " --stem torchvision");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("--stem torchvision is for resnet18, resnet34 and resnet50"),
            std::string::npos)
      << r.output;
  hddp::testing::removeTree(dir);
}
