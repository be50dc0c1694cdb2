// The Trainer's state files and exact resume: a state file's round trip, corruption
// detected, the last k kept, an overlong step number named, a crash halfway through a
// save; and a run stopped mid-epoch and resumed by fresh processes ends with the
// parameters of a run straight through, with plain DDP, with ZeRO re-sharded into
// another layout and with PowerSGD, also after a crash during a save.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "hddp/core/error.h"
#include "hddp/train/state_file.h"
#include "hddp/train/trainer.h"
#include "support/ranks.h"
#include "support/trainer_runs.h"
#include "train/state_file_seam.h"

namespace fs = std::filesystem;
using hddp::testing::envOr;
using hddp::testing::expectAllSucceeded;
using hddp::testing::runProcesses;
using hddp::testing::stateError;
using hddp::testing::trainRun;

namespace {

std::vector<at::Tensor> loadParams(const std::string& path) {
  std::vector<at::Tensor> out;
  torch::load(out, path);
  return out;
}

// A directory the parent creates and passes to the children through `var`.
std::string sharedDir(const char* var) {
  if (std::getenv("HDDP_TEST_CHILD_RANK") != nullptr) {
    return envOr(var);
  }
  const std::string dir = hddp::testing::makeTempDir();
  setenv(var, dir.c_str(), 1);
  return dir;
}

}  // namespace

TEST(StateFile, RoundTripAndDetectsCorruption) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::string path = hddp::stateFileName(dir, 12);
  EXPECT_EQ(fs::path(path).filename(), "state-00000012.hddp");
  std::string payload(10000, '\0');
  for (size_t i = 0; i < payload.size(); ++i) {
    payload[i] = static_cast<char>(i * 31 % 251);
  }
  hddp::writeStateFile(path, payload);
  EXPECT_EQ(hddp::readStateFile(path), payload);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_EQ(hddp::crc32Of("123456789", 9), 0xCBF43926u);  // the standard check value
  // One flipped byte.
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(5000);
    f.put('\x7f');
  }
  std::string message = stateError([&] { hddp::readStateFile(path); });
  EXPECT_NE(message.find("checksum mismatch"), std::string::npos) << message;
  EXPECT_NE(message.find(path), std::string::npos) << message;
  // Truncated.
  hddp::writeStateFile(path, payload);
  fs::resize_file(path, 3000);
  message = stateError([&] { hddp::readStateFile(path); });
  EXPECT_NE(message.find("truncated"), std::string::npos) << message;
  // Not a state file at all.
  std::ofstream(dir + "/other.hddp") << "hello";
  message = stateError([&] { hddp::readStateFile(dir + "/other.hddp"); });
  EXPECT_NE(message.find("not an hddp state file"), std::string::npos) << message;
}

TEST(StateFile, KeepsTheLastKAndRemovesLeftovers) {
  const std::string dir = hddp::testing::makeTempDir();
  for (int step : {30, 10, 20, 40}) {
    hddp::writeStateFile(hddp::stateFileName(dir, step), "x");
  }
  std::ofstream(hddp::stateFileName(dir, 50) + ".tmp") << "torn";
  auto files = hddp::listStateFiles(dir);
  ASSERT_EQ(files.size(), 4u);
  EXPECT_EQ(fs::path(files.front()).filename(), "state-00000010.hddp");
  hddp::pruneStateFiles(dir, 2);
  files = hddp::listStateFiles(dir);
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(fs::path(files[0]).filename(), "state-00000030.hddp");
  EXPECT_FALSE(fs::exists(hddp::stateFileName(dir, 50) + ".tmp"));
}

// A file whose step number has more digits than hddp writes used to escape as
// std::out_of_range.
TEST(StateFile, OverlongStepNumberInAFileNameIsNamed) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::string name = "state-123456789012345678901234567890.hddp";
  std::ofstream(dir + "/" + name) << "x";
  try {
    hddp::listStateFiles(dir);
    FAIL() << "expected a ConfigError";
  } catch (const hddp::ConfigError& e) {
    const std::string m = e.what_without_backtrace();
    EXPECT_NE(m.find(name), std::string::npos) << m;
  }
}

namespace {

// This process dies halfway through writing its n-th state file from now on (exit code
// 86), through the write path's test seam.
void crashInSave(int n) {
  static std::atomic<int> target{0};
  static std::atomic<int> saves{0};
  target = n;
  saves = 0;
  hddp::detail::setStateWriteHook([](int fd, const std::string& tmp, const std::string& payload) {
    if (++saves != target.load()) {
      return;
    }
    const ssize_t half = static_cast<ssize_t>(payload.size() / 2);
    if (::write(fd, payload.data(), static_cast<size_t>(half)) != half) {
      std::fprintf(stderr, "test: short write to %s\n", tmp.c_str());
    }
    ::fsync(fd);
    std::fprintf(stderr, "test: exiting halfway through %s\n", tmp.c_str());
    std::fflush(stderr);
    std::_Exit(86);
  });
}

}  // namespace

TEST(StateFile, CrashDuringSaveLeavesThePreviousFileLoadable) {
  const std::string dir = sharedDir("HDDP_TEST_STATE_DIR");
  auto outcomes = runProcesses(1, [](int, int, hddp::Store&) {
    crashInSave(2);
    const std::string d = envOr("HDDP_TEST_STATE_DIR");
    hddp::writeStateFile(hddp::stateFileName(d, 1), std::string(100000, 'a'));
    hddp::writeStateFile(hddp::stateFileName(d, 2), std::string(100000, 'b'));  // dies here
  });
  ASSERT_EQ(outcomes.size(), 1u);
  EXPECT_TRUE(outcomes[0].exited);
  EXPECT_EQ(outcomes[0].exitCode, 86) << outcomes[0].output;
  EXPECT_EQ(hddp::readStateFile(hddp::stateFileName(dir, 1)), std::string(100000, 'a'));
  EXPECT_FALSE(fs::exists(hddp::stateFileName(dir, 2)));
  EXPECT_TRUE(fs::exists(hddp::stateFileName(dir, 2) + ".tmp"));  // the torn write
  EXPECT_EQ(hddp::listStateFiles(dir).size(), 1u);
}

namespace {

// The phases of the multi-process tests; the parent picks one with HDDP_TEST_PHASE.
void phaseBody(int rank, int size, hddp::Store& store) {
  const std::string phase = envOr("HDDP_TEST_PHASE");
  const std::string d = envOr("HDDP_TEST_TRAIN_DIR");
  // HDDP_TEST_COMPRESS=powersgd: gradients through PowerSGD from step 2 on.
  const bool powerSgd = envOr("HDDP_TEST_COMPRESS") == "powersgd";
  auto compress = [powerSgd](hddp::TrainerOptions& o) {
    if (powerSgd) {
      o.ddp.compression = hddp::GradCompression::PowerSgd;
      o.ddp.powerSgd.startStep = 2;
    }
  };
  if (phase == "straight") {
    trainRun(
        rank, size, store,
        [&](hddp::TrainerOptions& o) {
          compress(o);
          o.saveDir = d + "/a";
          o.maxSteps = 10;
        },
        d + "/straight.pt");
  } else if (phase == "first") {
    auto s = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      compress(o);
      o.saveDir = d + "/b";
      o.maxSteps = 6;  // stops in the middle of the second epoch (4 steps per epoch)
    });
    EXPECT_EQ(s.totalSteps, 6);
  } else if (phase == "second") {
    auto s = trainRun(
        rank, size, store,
        [&](hddp::TrainerOptions& o) {
          compress(o);
          o.saveDir = d + "/b";
          o.resume = d + "/b";
          o.maxSteps = 10;
        },
        d + "/resumed.pt");
    EXPECT_EQ(s.steps, 4);
    EXPECT_EQ(s.totalSteps, 10);
  } else if (phase == "crash") {
    crashInSave(2);  // rank 0 dies writing its 2nd state file
    trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.saveDir = d + "/c";
      o.saveEvery = 2;
      o.maxSteps = 8;
    });
  } else if (phase == "after-crash") {
    auto s = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.saveDir = d + "/c";
      o.resume = d + "/c";
      o.maxSteps = 6;
    });
    EXPECT_EQ(s.totalSteps, 6);
    EXPECT_EQ(s.steps, 4);  // resumed at step 2, the last complete save
  } else {
    ADD_FAILURE() << "unknown phase '" << phase << "'";
  }
}

std::vector<hddp::testing::ProcessOutcome> runPhase(const char* phase) {
  if (std::getenv("HDDP_TEST_CHILD_RANK") == nullptr) {  // a child keeps its parent's phase
    setenv("HDDP_TEST_PHASE", phase, 1);
  }
  return runProcesses(2, phaseBody);
}

// The parameters the straight run and the resumed one ended with are the same.
void expectResumedEqualsStraight(const std::string& dir) {
  const auto straight = loadParams(dir + "/straight.pt");
  const auto resumed = loadParams(dir + "/resumed.pt");
  ASSERT_EQ(straight.size(), resumed.size());
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_TRUE(at::allclose(straight[i], resumed[i], /*rtol=*/0, /*atol=*/1e-6))
        << "tensor " << i << " differs by "
        << (straight[i].to(at::kDouble) - resumed[i].to(at::kDouble)).abs().max().item<double>();
  }
}

}  // namespace

TEST(Trainer, ResumeInFreshProcessesMatchesTrainingStraightThrough) {
  const std::string dir = sharedDir("HDDP_TEST_TRAIN_DIR");
  expectAllSucceeded(runPhase("straight"));
  expectAllSucceeded(runPhase("first"));
  ASSERT_FALSE(hddp::listStateFiles(dir + "/b").empty());
  expectAllSucceeded(runPhase("second"));
  expectResumedEqualsStraight(dir);
}

// ZeRO: the first run shards the momentum 1:3 (stage 2), the resumed one 3:1 (stage 1),
// against plain DDP straight through: the state file's parts re-shard into the other
// layout, and the result is the same.
TEST(Trainer, ZeroStateResumesIntoOtherShardsAndMatchesPlainDdpStraightThrough) {
  const std::string dir = sharedDir("HDDP_TEST_TRAIN_DIR");
  const bool child = std::getenv("HDDP_TEST_CHILD_RANK") != nullptr;
  if (!child) {
    setenv("HDDP_TEST_ZERO", "0 -", 1);
  }
  expectAllSucceeded(runPhase("straight"));
  if (!child) {
    setenv("HDDP_TEST_ZERO", "2 1:3", 1);
  }
  expectAllSucceeded(runPhase("first"));
  if (!child) {
    setenv("HDDP_TEST_ZERO", "1 3:1", 1);
  }
  expectAllSucceeded(runPhase("second"));
  if (!child) {
    unsetenv("HDDP_TEST_ZERO");
  }
  expectResumedEqualsStraight(dir);
}

// The same with PowerSGD from step 2: the state file carries the hook's step, its Q
// memories and each rank's error memory, so the resumed run goes on exactly as the
// straight one (without them the Q would be drawn afresh and the errors lost).
TEST(Trainer, ResumeWithPowerSgdMatchesTrainingStraightThrough) {
  if (std::getenv("HDDP_TEST_CHILD_RANK") == nullptr) {
    setenv("HDDP_TEST_COMPRESS", "powersgd", 1);
  }
  const std::string dir = sharedDir("HDDP_TEST_TRAIN_DIR");
  expectAllSucceeded(runPhase("straight"));
  expectAllSucceeded(runPhase("first"));
  expectAllSucceeded(runPhase("second"));
  unsetenv("HDDP_TEST_COMPRESS");
  expectResumedEqualsStraight(dir);
}

TEST(Trainer, CrashDuringSaveThenResumeFromTheLastGoodState) {
  const std::string dir = sharedDir("HDDP_TEST_TRAIN_DIR");
  auto crashed = runPhase("crash");
  ASSERT_EQ(crashed.size(), 2u);
  EXPECT_EQ(crashed[0].exitCode, 86) << crashed[0].output;
  auto files = hddp::listStateFiles(dir + "/c");
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(fs::path(files[0]).filename(), "state-00000002.hddp");
  EXPECT_TRUE(fs::exists(hddp::stateFileName(dir + "/c", 4) + ".tmp"));
  expectAllSucceeded(runPhase("after-crash"));
  EXPECT_FALSE(fs::exists(hddp::stateFileName(dir + "/c", 4) + ".tmp"));  // cleaned up
}
