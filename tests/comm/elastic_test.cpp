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
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "hddp_protocol/job_record.h"
#include "support/elastic_runs.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runCommand;

std::string launcher() { return hddp::testing::toolsDir() + "/hddp-run"; }
std::string worker() { return HDDP_TEST_WORKER; }
using hddp::testing::probe;
using hddp::testing::probeJob;
using hddp::testing::stepsOf;

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

// The record's arithmetic on a hand-written job: slot 1 unplugged at 10.0 (hddp-run saw
// it at 10.2), generation 1's first step at 12.5: re-forming took 12.5 - 10.0 = 2.5 s;
// back at 20.0, the ranks left at 21.0, generation 2's first step at 22.25: 1.25 s.
// Repeated steps: 4 + 0. The torn last line (a writer killed mid-line) is skipped.
TEST(Elastic, TheJobRecordSaysWhoLeftWhenTheyCameBackAndHowLongReformingTook) {
  const std::string dir = hddp::testing::makeTempDir();
  std::ofstream(dir + "/job.jsonl")
      << R"({"t":0.0,"event":"job","generation":0,"min":1,"max":2,"pid":42})"
         "\n"
      << R"({"t":0.1,"event":"generation","generation":0,"slots":[0,1]})"
         "\n"
      << R"({"t":1.0,"event":"started","generation":0,"step":0,"repeated":0,"commits":"C"})"
         "\n"
      << R"({"t":9.0,"event":"commit","generation":0,"step":36,"file":"C/state-36"})"
         "\n"
      << R"({"t":10.0,"event":"unplug","generation":0,"slot":1})"
         "\n"
      << R"({"t":10.2,"event":"left","generation":0,"slot":1,"why":"killed"})"
         "\n"
      << R"({"t":10.3,"event":"generation","generation":1,"slots":[0]})"
         "\n"
      << R"({"t":11.0,"event":"resumed","generation":1,"step":36,"repeated":4,"commits":"C"})"
         "\n"
      << R"({"t":12.5,"event":"first_step","generation":1,"step":37})"
         "\n"
      << R"({"t":20.0,"event":"back","generation":1,"slots":[1]})"
         "\n"
      << R"({"t":21.0,"event":"reform","generation":1})"
         "\n"
      << R"({"t":21.1,"event":"generation","generation":2,"slots":[0,1]})"
         "\n"
      << R"({"t":22.0,"event":"resumed","generation":2,"step":50,"repeated":0,"commits":"C"})"
         "\n"
      << R"({"t":22.25,"event":"first_step","generation":2,"step":51})"
         "\n"
      << R"({"t":23.0,"event":"commit","gener)";
  const auto job = hddp::jobrecord::read(dir);
  EXPECT_EQ(job.skippedLines, 1);
  ASSERT_EQ(job.generations.size(), 3u);
  EXPECT_DOUBLE_EQ(hddp::jobrecord::reformSeconds(job.generations[0]), -1);
  EXPECT_DOUBLE_EQ(hddp::jobrecord::reformSeconds(job.generations[1]), 2.5);
  EXPECT_DOUBLE_EQ(hddp::jobrecord::reformSeconds(job.generations[2]), 1.25);
  EXPECT_EQ(hddp::jobrecord::repeatedSteps(job), 4);
  ASSERT_EQ(job.departures.size(), 1u);
  EXPECT_NEAR(job.departures[0].back - job.departures[0].at, 9.8, 1e-9);
  EXPECT_EQ(job.commitStep, 36);
  EXPECT_FALSE(job.ended);
  std::string text;
  for (const auto& line : hddp::jobrecord::describe(job, 30.0)) {
    text += line + "\n";
  }
  EXPECT_NE(text.find("10.2 s  slot 1 left: killed\n  10.3 s  generation 1: 1 rank(s) on slots 0; "
                      "resumed at step 36, 4 step(s) trained again; first step 2.5 s after slot 1 "
                      "unplugged"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("newest commit: step 36 at 9.0 s (21.0 s ago)"), std::string::npos) << text;
  EXPECT_NE(text.find("running for 30.0 s; 3 generation(s), 1 departure(s), 4 step(s) trained "
                      "again, re-forming 1.9 s on average (longest 2.5 s)"),
            std::string::npos)
      << text;
  std::ofstream(dir + "/job.jsonl") << R"({"t":1.0,"event":"commit","generation":0})"
                                       "\n";
  EXPECT_THROW(hddp::jobrecord::read(dir), std::runtime_error);
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
  auto r =
      runCommand("HDDP_LOG_LEVEL=info HDDP_LOG_SAMPLES=" + elastic + "/samples " + launcher() +
                 " --nproc-per-node 2:3 --rejoin-every 0.25 --emulate-unplug " + unplug +
                 " --job-dir " + elastic + "/job -- " + worker() + " elastic-train " + elastic);
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
  hddp::testing::expectEachEpochOnceAsTheReference(trained, reference);
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
  // The job record (hddp-probe --job) tells the same story, and hddp-run's summary.
  EXPECT_NE(r.output.find("3 generation(s), 1 departure(s), " + std::to_string(logged) +
                          " step(s) trained again, re-forming"),
            std::string::npos)
      << r.output;
  const nlohmann::json job = probeJob(elastic + "/job");
  ASSERT_TRUE(job.is_object()) << job;
  EXPECT_EQ(job["ended"], true);
  EXPECT_EQ(job["exit_code"], 0);
  EXPECT_EQ(job["repeated_steps"], logged) << job;
  ASSERT_EQ(job["generations"].size(), 3u) << job;
  EXPECT_EQ(job["generations"][1]["slots"], nlohmann::json({0, 1}));
  EXPECT_EQ(job["generations"][2]["slots"], nlohmann::json({0, 1, 2}));
  for (int g = 1; g <= 2; ++g) {
    const double reform = job["generations"][g]["reform_s"].get<double>();
    EXPECT_GT(reform, 0.0) << job;
    EXPECT_LT(reform, 30.0) << job;
  }
  ASSERT_EQ(job["departures"].size(), 1u) << job;
  const auto& left = job["departures"][0];
  EXPECT_EQ(left["slot"], 2);
  EXPECT_NE(left["why"].get<std::string>().find("signal 9"), std::string::npos) << job;
  EXPECT_NEAR(left["left_s"].get<double>(), at, 1.0) << job;
  ASSERT_TRUE(left["back_s"].is_number()) << job;
  EXPECT_GE(left["back_s"].get<double>(), at + 1.5 - 0.1) << job;
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
  auto r = runCommand(launcher() + " --nproc-per-node 3:3 --emulate-unplug 1@1.5 --job-dir " + dir +
                      "/job -- " + worker() + " elastic-train " + dir);
  EXPECT_EQ(r.exitCode, 1) << r.output;
  EXPECT_NE(r.output.find("fewer than the minimum 3; slot 1: rank 1 was killed by signal 9"),
            std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 30.0) << r.output;
  // The folder stays for a look at what happened; a second job may not reuse it.
  const nlohmann::json job = probeJob(dir + "/job");
  EXPECT_EQ(job["ended"], true) << job;
  EXPECT_EQ(job["exit_code"], 1) << job;
  ASSERT_EQ(job["departures"].size(), 1u) << job;
  EXPECT_EQ(job["departures"][0]["slot"], 1) << job;
  auto again = runCommand(launcher() + " --nproc-per-node 1:2 --job-dir " + dir + "/job -- " +
                          worker() + " allreduce");
  EXPECT_EQ(again.exitCode, 1) << again.output;
  EXPECT_NE(again.output.find("holds an earlier job's record"), std::string::npos) << again.output;
  auto none = runCommand(probe() + " --job " + dir);
  EXPECT_EQ(none.exitCode, 1) << none.output;
  EXPECT_NE(none.output.find("not an elastic job's folder"), std::string::npos) << none.output;
}

namespace {

// `hddp-run --nproc-per-node 2:3` around `wrapper`: slot 2 is unplugged at 0.3 s and
// may come back at 0.6 s, so the re-form request (SIGUSR1) reaches generation 1's
// ranks while they are still starting.
hddp::testing::CommandResult reformWhileStarting(const std::string& dir,
                                                 const std::string& wrapper) {
  return runCommand(launcher() + " --nproc-per-node 2:3 --rejoin-every 0.1 --emulate-unplug " +
                    "2@0.3:0.6 -- " + wrapper + " " + worker() + " elastic-train " + dir);
}

}  // namespace

// The re-form signal (SIGUSR1) reaches every rank; one still in its first second (here
// inside a wrapper script that sleeps before it execs the program) must not die of it:
// hddp-run ignores the signal in the child before exec, and the rank finds the re-form
// request in the job's folder at its first commit.
TEST(Elastic, AWrapperScriptAndARankStillStartingReformCleanly) {
  const std::string dir = hddp::testing::makeTempDir();
  auto r = reformWhileStarting(dir, "sh -c 'sleep 1.5; exec \"$0\" \"$@\"'");
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_EQ(r.output.find("signal 10"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("generation 1: 2 rank(s) on slots 0,1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("generation 2: 3 rank(s) on slots 0,1,2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("trained 150 steps"), std::string::npos) << r.output;
}

// A usage error on every rank (a configuration error, exit 2, or a flag CLI11 rejects,
// e.g. 105) ends an elastic job at once with the rank's message: re-forming without a
// slot cannot fix it (it used to re-form until fewer than the minimum were left). Any
// other failure still re-forms without the slot.
TEST(Elastic, AUsageErrorOnEveryRankEndsTheJobAtOnce) {
  for (int code : {2, 105}) {
    auto r =
        runCommand(launcher() + " --nproc-per-node 2:3 -- sh -c 'echo \"bad flag\" >&2; exit " +
                   std::to_string(code) + "'");
    EXPECT_EQ(r.exitCode, code) << r.output;
    EXPECT_NE(r.output.find("a usage error"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("bad flag"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("generation 1"), std::string::npos) << r.output;
  }
  auto other = runCommand(launcher() + " --nproc-per-node 1:2 --max-restarts 1 -- sh -c 'exit 3'");
  EXPECT_NE(other.output.find(" left: rank "), std::string::npos) << other.output;
  EXPECT_EQ(other.output.find("a usage error"), std::string::npos) << other.output;
  // Code 2 on one rank alone (its device, say) is that slot's departure: the job goes on.
  auto alone = runCommand(launcher() + " --nproc-per-node 2:3 --rejoin-every 1000 -- sh -c " +
                          "'if [ \"$HDDP_SLOT\" = 1 ]; then exit 2; fi; sleep 3'");
  EXPECT_EQ(alone.exitCode, 0) << alone.output;
  EXPECT_NE(alone.output.find("slot 1 left"), std::string::npos) << alone.output;
  EXPECT_EQ(alone.output.find("a usage error"), std::string::npos) << alone.output;
}

// Per-rank options of an elastic job name slots: with slot 2 emulated slower, the
// generation that re-forms without it (2 ranks) runs on, where "2:2" used to name a
// rank that no longer exists and ended the job.
TEST(Elastic, PerRankOptionsNameSlotsAndSurviveAReforming) {
  const std::string dir = hddp::testing::makeTempDir();
  auto r = runCommand("HDDP_EMULATE_SLOWDOWN=2:2 HDDP_LOG_LEVEL=info " + launcher() +
                      " --nproc-per-node 2:3 --rejoin-every 1000 --emulate-unplug 2@1.5 -- " +
                      worker() + " elastic-train " + dir);
  EXPECT_EQ(r.exitCode, 0) << r.output;
  EXPECT_NE(r.output.find("generation 1: 2 rank(s) on slots 0,1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("slot 2 is not in this generation"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("trained 150 steps"), std::string::npos) << r.output;
}

// Progress marks belong to one job: marks an earlier job left in a reused save folder
// do not count as steps this job trained (they skewed the "trained again" count).
TEST(Elastic, ProgressMarksOfAnEarlierJobInTheFolderDoNotCount) {
  const std::string dir = hddp::testing::makeTempDir();
  setenv("TORCHELASTIC_RUN_ID", "hddp-earlier", 1);
  {
    hddp::train::ProgressMark mark;
    mark.open(dir, 1);
    mark.write(99);
  }
  EXPECT_EQ(hddp::train::ProgressMark::newest(dir), 99);
  setenv("TORCHELASTIC_RUN_ID", "hddp-this", 1);
  EXPECT_EQ(hddp::train::ProgressMark::newest(dir), -1);
  {
    hddp::train::ProgressMark mark;
    mark.open(dir, 0);
    mark.write(5);
  }
  EXPECT_EQ(hddp::train::ProgressMark::newest(dir), 5);
  unsetenv("TORCHELASTIC_RUN_ID");
}
