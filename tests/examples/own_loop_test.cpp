// examples/own_loop, a LibTorch loop of its own made distributed with hddp's parts and no
// Trainer: on two ranks with an unequal split and a rank that runs out of memory, its
// parameters equal the Trainer's on the same seed and data; killed halfway, it resumes
// from its newest commit under hddp-run and ends as a straight run.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <vector>

#include "support/disk.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runCommand;

std::string hddpRun(const std::string& env, const std::string& runFlags, const std::string& flags) {
  return env + " " + hddp::testing::toolsDir() + "/hddp-run --nproc-per-node 2 " + runFlags +
         " -- " + HDDP_TEST_OWN_LOOP + " " + flags + " 2>&1";
}

std::vector<at::Tensor> parametersIn(const std::string& path) {
  std::vector<at::Tensor> params;
  torch::load(params, path);
  return params;
}

void expectSameParameters(const std::string& a, const std::string& b) {
  const auto pa = parametersIn(a);
  const auto pb = parametersIn(b);
  ASSERT_EQ(pa.size(), pb.size());
  ASSERT_FALSE(pa.empty());
  for (size_t i = 0; i < pa.size(); ++i) {
    // float32 sums in another order (other splits): equal to rounding.
    EXPECT_TRUE(at::allclose(pa[i], pb[i], 1e-4, 1e-5))
        << "parameter " << i << " differs by " << (pa[i] - pb[i]).abs().max().item<float>();
  }
}

TEST(OwnLoop, AnUnequalSplitAndAnOutOfMemoryRecoveryTrainAsTheTrainerDoes) {
  const std::string dir = hddp::testing::makeTempDir();
  // Rank 1 may take 10 samples of 32 and runs out of memory above 9: one step is given up
  // and repeated under the split [23, 9].
  const std::string env = "HDDP_LOG_LEVEL=warn HDDP_EMULATE_MEMORY_CAP=1:9";
  const auto own = runCommand(
      hddpRun(env, "", "--max-steps 12 --max-local-batch 0,10 --save-params " + dir + "/own.pt"));
  ASSERT_EQ(own.exitCode, 0) << own.output;
  EXPECT_NE(own.output.find("own loop: 12 steps"), std::string::npos) << own.output;
  EXPECT_NE(own.output.find("1 steps repeated"), std::string::npos) << own.output;
  const auto trainer = runCommand(hddpRun(
      "HDDP_LOG_LEVEL=warn", "", "--trainer --max-steps 12 --save-params " + dir + "/trainer.pt"));
  ASSERT_EQ(trainer.exitCode, 0) << trainer.output;
  EXPECT_NE(trainer.output.find("trainer: 12 steps"), std::string::npos) << trainer.output;
  expectSameParameters(dir + "/own.pt", dir + "/trainer.pt");
  hddp::testing::removeTree(dir);
}

// Three epochs of 4 steps: the commit of step 4 falls on the first epoch's end, the kill
// in the second epoch, and the run ends with the epochs (no --max-steps).
TEST(OwnLoop, AKilledRunResumesFromItsNewestCommitAndEndsAsAStraightRun) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::string job = "--samples 128 --epochs 3 ";
  const auto straight =
      runCommand(hddpRun("HDDP_LOG_LEVEL=warn", "", job + "--save-params " + dir + "/straight.pt"));
  ASSERT_EQ(straight.exitCode, 0) << straight.output;
  // Rank 1 is killed before step 7; hddp-run restarts the job, which resumes from the
  // commit of step 4 (steps 5 and 6 are trained again, nothing is skipped).
  const auto killed = runCommand(hddpRun(
      "HDDP_LOG_LEVEL=info HDDP_FAULT='kill@step=7,rank=1'", "--max-restarts 1",
      job + "--save-dir " + dir + "/ckpt --save-every 4 --save-params " + dir + "/killed.pt"));
  ASSERT_EQ(killed.exitCode, 0) << killed.output;
  EXPECT_NE(killed.output.find("resumed from " + dir + "/ckpt/commit-00000004.hddp"),
            std::string::npos)
      << killed.output;
  EXPECT_NE(killed.output.find("own loop: 12 steps"), std::string::npos) << killed.output;
  expectSameParameters(dir + "/straight.pt", dir + "/killed.pt");
  EXPECT_TRUE(std::filesystem::exists(dir + "/ckpt/commit-00000012.hddp"));
  hddp::testing::removeTree(dir);
}

}  // namespace
