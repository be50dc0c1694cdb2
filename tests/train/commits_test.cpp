// hddp::Commits (hddp/train/commits.h): commits for a loop of one's own, written by rank 0
// and resumed on every rank; a damaged newer commit gives way to the one before and is
// moved aside, so the pruning after the next commit cannot delete that commit.
#include "hddp/train/commits.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/train/state_file.h"
#include "support/disk.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runThreads;

void writeValue(torch::serialize::OutputArchive& a, double v) {
  a.write("value", torch::tensor(std::vector<double>{v}, torch::kDouble));
}

double readValue(torch::serialize::InputArchive& a) {
  at::Tensor t;
  a.read("value", t);
  return t.item<double>();
}

TEST(Commits, ResumeTakesTheNewestWholeCommitOnEveryRankAndMovesADamagedOneAside) {
  const std::string top = hddp::testing::makeTempDir();
  const std::string dir = top + "/commits";  // made by the first commit
  std::vector<double> resumed(2, -1);
  std::vector<int64_t> steps(2, -1);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    hddp::Commits commits(*comm, dir, /*keepLast=*/2);
    EXPECT_FALSE(commits.resume([](torch::serialize::InputArchive&) {}).has_value());
    commits.save(1, [](torch::serialize::OutputArchive& a) { writeValue(a, 1.5); });
    commits.save(2, [](torch::serialize::OutputArchive& a) { writeValue(a, 2.5); });
    comm->barrier().wait();
    if (rank == 0) {  // commit 2 torn on the disk
      std::ofstream(commits.fileOf(2), std::ios::binary | std::ios::trunc) << "HDDPST01 torn";
    }
    comm->barrier().wait();
    const auto step = commits.resume([&](torch::serialize::InputArchive& a) {
      resumed[static_cast<size_t>(rank)] = readValue(a);
    });
    steps[static_cast<size_t>(rank)] = step.value_or(-1);
    // The next commit keeps commit 1 (keepLast 2): the damaged file no longer counts.
    commits.save(3, [](torch::serialize::OutputArchive& a) { writeValue(a, 3.5); });
  });
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(resumed, (std::vector<double>{1.5, 1.5}));
  const auto files = hddp::listStateFiles(dir, "commit-");
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0], hddp::stateFileName(dir, 1, "commit-"));
  EXPECT_EQ(files[1], hddp::stateFileName(dir, 3, "commit-"));
  EXPECT_TRUE(std::ifstream(hddp::stateFileName(dir, 2, "commit-") + ".damaged").good());
  hddp::testing::removeTree(top);
}

TEST(Commits, AReadThatFailsOnOneRankFailsTheResumeOnEveryRank) {
  const std::string dir = hddp::testing::makeTempDir();
  std::vector<std::string> errors(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    hddp::Commits commits(*comm, dir);
    commits.save(4, [](torch::serialize::OutputArchive& a) { writeValue(a, 4.0); });
    try {
      commits.resume([&](torch::serialize::InputArchive& a) {
        at::Tensor missing;
        if (rank == 1) {
          a.read("not_there", missing);  // LibTorch refuses: no such entry
        }
      });
    } catch (const hddp::StateError& e) {
      errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
    }
    EXPECT_THROW(hddp::Commits(*comm, ""), hddp::ConfigError);
    EXPECT_THROW(hddp::Commits(*comm, dir, 0), hddp::ConfigError);
  });
  EXPECT_NE(errors[0].find("failed on rank 1"), std::string::npos) << errors[0];
  EXPECT_FALSE(errors[1].empty());
  hddp::testing::removeTree(dir);
}

}  // namespace
