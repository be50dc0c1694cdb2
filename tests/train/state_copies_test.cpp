// A state file named by a relative path is read by each rank where it runs: on node-local
// disks the ranks may hold different copies. Two copies of other commits are refused with
// a StateError on every rank (they would load different models, and whether the
// planner's part is loaded, a collective, would differ from rank to rank: a hang); two
// copies of one commit load.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>

#include "hddp/hddp.h"
#include "support/mlp_job.h"
#include "support/ranks.h"

namespace fs = std::filesystem;
using hddp::testing::runProcesses;
using hddp::testing::runThreads;

namespace {

using Job = hddp::testing::MlpJob<>;  // tests/support/mlp_job.h

// The newest state file of a two-rank run of `steps` steps.
fs::path savedFile(int64_t steps) {
  const std::string dir = hddp::testing::makeTempDir();
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    Job job(rank, size, store, dir, steps);
    job.trainer->fit();
  });
  fs::path newest;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() == ".hddp" &&
        (newest.empty() || entry.path().filename() > newest.filename())) {
      newest = entry.path();
    }
  }
  return newest;
}

// Rank r resumes from "state.hddp" in its own working directory, <root>/rank<r>, which
// holds `copies[r]`; returns how the ranks ended. The root travels to the children in
// the environment (they re-run this test up to runProcesses).
std::vector<hddp::testing::ProcessOutcome> resumeFromCopies(const std::vector<fs::path>& copies,
                                                            bool expectRefusal) {
  if (std::getenv("HDDP_TEST_CHILD_RANK") == nullptr) {
    const std::string root = hddp::testing::makeTempDir();
    for (size_t r = 0; r < copies.size(); ++r) {
      const fs::path own = fs::path(root) / ("rank" + std::to_string(r));
      fs::create_directories(own);
      fs::copy_file(copies[r], own / "state.hddp");
    }
    setenv("HDDP_TEST_COPIES_ROOT", root.c_str(), 1);
  }
  return runProcesses(2, [expectRefusal](int rank, int size, hddp::Store& store) {
    const fs::path own =
        fs::path(std::getenv("HDDP_TEST_COPIES_ROOT")) / ("rank" + std::to_string(rank));
    ASSERT_EQ(chdir(own.c_str()), 0) << own;
    Job job(rank, size, store, "", /*maxSteps=*/6);
    if (expectRefusal) {
      try {
        job.trainer->load("state.hddp");
        ADD_FAILURE() << "rank " << rank << " loaded another copy than its peer's";
      } catch (const hddp::StateError& e) {
        EXPECT_NE(std::string(e.what()).find("every rank must resume from the same file"),
                  std::string::npos)
            << e.what();
      }
    } else {
      job.trainer->load("state.hddp");
      job.trainer->fit();  // and trains on together
    }
  });
}

}  // namespace

TEST(StateCopies, RanksHoldingCopiesOfOtherCommitsAreRefusedOnEveryRank) {
  std::vector<fs::path> copies;
  if (std::getenv("HDDP_TEST_CHILD_RANK") == nullptr) {
    copies = {savedFile(3), savedFile(2)};  // step 3 with a planner part; step 2
  }
  hddp::testing::expectAllSucceeded(resumeFromCopies(copies, /*expectRefusal=*/true));
}

TEST(StateCopies, CopiesOfOneCommitLoad) {
  std::vector<fs::path> copies;
  if (std::getenv("HDDP_TEST_CHILD_RANK") == nullptr) {
    const fs::path one = savedFile(3);
    copies = {one, one};
  }
  hddp::testing::expectAllSucceeded(resumeFromCopies(copies, /*expectRefusal=*/false));
}
