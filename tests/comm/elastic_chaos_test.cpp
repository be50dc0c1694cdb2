// Chaos on purpose (issue #49 part 4): an elastic job of 3 ranks (MIN 2) meets five
// faults of mixed kinds through HDDP_FAULT (kills, a failed collective, a rank that runs
// slow), each in its own generation, and must end with exit code 0, every sample of
// every epoch trained, the same steps as an undisturbed run, and the job record counting
// the steps trained twice. And a rank that hangs is timed out by its peer and the group
// restarts. Bounded by ctest's timeout; no speed is required.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "support/elastic_runs.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runCommand;

std::string launcher() { return hddp::testing::toolsDir() + "/hddp-run"; }
std::string worker() { return HDDP_TEST_WORKER; }

// The faults, each once per job (HDDP_FAULT_ONCE_DIR) in whichever generation reaches
// its step with its slot in the group, so no generation number is pinned: slot 2 is
// killed at step 20, slot 1's 100th collective of a generation fails (a DDP bucket's
// allreduce during backward, about 40 steps into it), slot 0 (rank 0, the commits'
// writer) is killed at step 80, slot 1 runs 2 s slow in step 100 (no re-forming), slot
// 2 is killed again at step 115. A slot that left is back at the next rejoin check
// (`--rejoin-check true`, every 0.25 s), 30 steps before the next fault needs it.
constexpr const char* kFaults =
    "kill@step=20,slot=2,restart=*;"
    "raise@collective=100,slot=1,restart=*;"
    "kill@step=80,slot=0,restart=*;"
    "slow=2@step=100,slot=1,restart=*;"
    "kill@step=115,slot=2,restart=*";

TEST(Elastic, FiveFaultsOfMixedKindsLoseNoSampleAndTheRecordCountsTheRepeats) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::string chaos = dir + "/chaos";
  const std::string straight = dir + "/straight";
  std::filesystem::create_directories(chaos);
  std::filesystem::create_directories(straight);
  std::filesystem::create_directories(chaos + "/faults");
  auto r = runCommand(std::string("HDDP_FAULT='") + kFaults + "' HDDP_FAULT_ONCE_DIR=" + chaos +
                      "/faults HDDP_LOG_LEVEL=info HDDP_LOG_SAMPLES=" + chaos + "/samples " +
                      launcher() +
                      " --nproc-per-node 2:3 --rejoin-every 0.25 --rejoin-check true "
                      "--max-restarts 10 --job-dir " +
                      chaos + "/job -- " + worker() + " elastic-train " + chaos);
  ASSERT_EQ(r.exitCode, 0) << r.output;
  // Each fault was met (a killed rank's line may be cut off by the kill: counted by
  // its fault's text, logged before it acts).
  for (const char* fault :
       {"'kill@step=20,slot=2,restart=*'", "'raise@collective=100,slot=1,restart=*'",
        "'kill@step=80,slot=0,restart=*'", "'slow=2@step=100,slot=1,restart=*'",
        "'kill@step=115,slot=2,restart=*'"}) {
    const size_t first = r.output.find(std::string("injecting ") + fault);
    EXPECT_NE(first, std::string::npos) << fault << " was not met:\n" << r.output;
    EXPECT_EQ(r.output.find(std::string("injecting ") + fault, first + 1), std::string::npos)
        << fault << " acted twice";
  }
  EXPECT_NE(r.output.find("trained 150 steps"), std::string::npos) << r.output;
  auto s = runCommand("HDDP_LOG_SAMPLES=" + straight + "/samples " + launcher() +
                      " --nproc-per-node 3 -- " + worker() + " elastic-train " + straight);
  ASSERT_EQ(s.exitCode, 0) << s.output;
  int repeated = 0;
  int none = 0;
  const auto trained = hddp::testing::stepsOf(chaos + "/samples", &repeated);
  const auto reference = hddp::testing::stepsOf(straight + "/samples", &none);
  EXPECT_EQ(none, 0);
  ASSERT_EQ(trained.size(), 150u);
  ASSERT_EQ(reference.size(), 150u);
  hddp::testing::expectEachEpochOnceAsTheReference(trained, reference);
  // The record's count of repeated steps comes from each slot's last progress mark,
  // written just after the step's sample line: a rank killed between the two leaves it
  // one step short per departure (4 here).
  const nlohmann::json job = hddp::testing::probeJob(chaos + "/job");
  ASSERT_TRUE(job.is_object()) << job;
  EXPECT_EQ(job["ended"], true);
  EXPECT_EQ(job["exit_code"], 0);
  ASSERT_TRUE(job["repeated_steps"].is_number()) << job;
  const int recorded = job["repeated_steps"].get<int>();
  EXPECT_LE(recorded, repeated) << job;
  EXPECT_GE(recorded, repeated - 4) << job;
  EXPECT_EQ(job["departures"].size(), 4u) << job;
  std::printf("%d step(s) trained twice; the job record says %d; %zu generations\n", repeated,
              recorded, job["generations"].size());
  auto same =
      runCommand(worker() + " same-params " + chaos + "/final.pt " + straight + "/final.pt");
  EXPECT_EQ(same.exitCode, 0) << same.output;
}

// A rank that hangs (HDDP_FAULT hang@step=5 on rank 1: it sleeps before the step's
// forward and never sends) is found by its peer's collective timeout (HDDP_TIMEOUT_SEC=5):
// rank 0's allreduce fails, hddp-run stops the group, the hung rank with it, and the
// restarted group (the fault acts in the first attempt only) trains the epoch through.
TEST(Elastic, AHungRankIsTimedOutByItsPeerAndTheRestartedGroupTrains) {
  const std::string dir = hddp::testing::makeTempDir();
  auto r = runCommand("HDDP_FAULT='hang@step=5,rank=1' HDDP_TIMEOUT_SEC=5 " + launcher() +
                      " --nproc-per-node 2 --max-restarts 1 --grace-period 2 -- " + worker() +
                      " elastic-train " + dir + " - 1 0");
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("injecting 'hang@step=5,rank=1'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("restarting the group"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("trained 30 steps"), std::string::npos) << r.output;
  // Ended by the peer's timeout (not by the hang's hour: ctest's timeout would end it).
  EXPECT_NE(r.output.find("Timed out waiting 5000ms"), std::string::npos) << r.output;
}

}  // namespace
