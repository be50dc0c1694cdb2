// The Trainer and its state files: exact resume in fresh processes, a crash during a
// save, corrupt files, metrics and timeline output, and that training learns.
#include "hddp/train/trainer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/data/datasets.h"
#include "hddp/ddp/sync_batch_norm.h"
#include "hddp/train/state_file.h"
#include "support/ranks.h"
#include "train/state_file_seam.h"

namespace fs = std::filesystem;
using hddp::testing::expectAllSucceeded;
using hddp::testing::runProcesses;
using hddp::testing::runThreads;

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 6, 3).padding(1)));
    bn = register_module("bn", torch::nn::BatchNorm2d(6));
    drop = register_module("drop", torch::nn::Dropout(0.0));
    fc = register_module("fc", torch::nn::Linear(6 * 8 * 8, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(bn->forward(conv->forward(x)));
    return fc->forward(drop->forward(h.flatten(1)));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Net);

// Net with SyncBatchNorm: every rank must run its forward collectives in every step.
struct SyncNetImpl : torch::nn::Module {
  SyncNetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 6, 3).padding(1)));
    bn = register_module("bn", hddp::SyncBatchNorm(6));
    fc = register_module("fc", torch::nn::Linear(6 * 8 * 8, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc->forward(torch::relu(bn->forward(conv->forward(x))).flatten(1));
  }
  torch::nn::Conv2d conv{nullptr};
  hddp::SyncBatchNorm bn{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(SyncNet);

std::string envOr(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// One training run as the tests configure it through the environment (children of
// runProcesses re-run the test from the top, so every phase goes through here).
hddp::TrainSummary trainRun(int rank, int size, hddp::Store& store,
                            const std::function<void(hddp::TrainerOptions&)>& configure,
                            const std::string& paramsOut = "") {
  auto comm = hddp::makeCommunicator(store, rank, size);
  torch::manual_seed(100 + rank);  // dropout draws differ per rank
  Net model;
  // HDDP_TEST_ZERO="STAGE SHARD_BY" (ZeRO; "0 -" for plain DDP) trains with momentum, so
  // that the optimizer has state to shard, save and load.
  const std::string zero = envOr("HDDP_TEST_ZERO");
  torch::optim::SGD opt(model->parameters(),
                        torch::optim::SGDOptions(0.05).momentum(zero.empty() ? 0.0 : 0.9));
  hddp::TrainerOptions o;
  if (!zero.empty()) {
    o.zero = std::stoi(zero.substr(0, 1));
    if (o.zero > 0) {
      o.shardBy = hddp::parseShardBy(zero.substr(2));
    }
  }
  o.globalBatch = 24;
  o.epochs = 3;
  o.balance = false;
  o.progress = hddp::ProgressMode::Off;
  o.loader.workers = 2;
  configure(o);
  auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(80, 1, 8, 4, /*seed=*/1);
  hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt, ds,
                        o);
  trainer.setSchedule([](const hddp::StepInfo& info, torch::optim::Optimizer& optimizer) {
    hddp::setLearningRate(optimizer, 0.05 / (1.0 + 0.1 * static_cast<double>(info.step)));
  });
  auto summary = trainer.fit();
  if (rank == 0 && !paramsOut.empty()) {
    std::vector<at::Tensor> state;
    for (const auto& p : model->parameters()) {
      state.push_back(p.detach().clone());
    }
    for (const auto& b : model->buffers()) {
      state.push_back(b.detach().clone());
    }
    torch::save(state, paramsOut);
  }
  return summary;
}

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

std::string stateError(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const hddp::StateError& e) {
    return e.what_without_backtrace();
  }
  return "(no StateError)";
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

TEST(Trainer, CorruptStateFileIsReportedAndSkippedInADirectory) {
  const std::string dir = hddp::testing::makeTempDir();
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.saveDir = dir;
      o.saveEvery = 2;
      o.maxSteps = 4;
    });
  });
  const std::string newest = hddp::stateFileName(dir, 4);
  ASSERT_TRUE(fs::exists(newest));
  {
    std::fstream f(newest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x01');
    f.put('\x02');
  }
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    const std::string message = stateError(
        [&] { trainRun(rank, size, store, [&](hddp::TrainerOptions& o) { o.resume = newest; }); });
    EXPECT_NE(message.find("corrupt"), std::string::npos) << message;
    EXPECT_NE(message.find("state-00000004.hddp"), std::string::npos) << message;
  });
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto s = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.resume = dir;  // the newest valid file: step 2
      o.maxSteps = 5;
    });
    EXPECT_EQ(s.steps, 3);
  });
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    const std::string message = stateError([&] {
      trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
        o.resume = dir;
        o.globalBatch = 32;
      });
    });
    EXPECT_NE(message.find("global batch"), std::string::npos) << message;
  });
}

TEST(Trainer, AnEmptyOrMissingFolderStartsFreshAndARestartResumesByItself) {
  const std::string dir = hddp::testing::makeTempDir();
  fs::create_directories(dir + "/empty");
  for (const std::string& nothing : {dir + "/empty", dir + "/not-made-yet"}) {
    runThreads(1, [&](int rank, int size, hddp::Store& store) {
      auto s = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
        o.resume = nothing;  // what `--save-dir D --resume D` gives at the first start
        o.saveDir = dir + "/run";
        o.saveEvery = 2;
        o.maxSteps = 4;
      });
      EXPECT_EQ(s.steps, 4) << nothing;
      EXPECT_EQ(s.totalSteps, 4) << nothing;
    });
  }
  runThreads(1, [&](int rank, int size, hddp::Store& store) {  // a missing file stays an error
    const std::string message = stateError([&] {
      trainRun(rank, size, store,
               [&](hddp::TrainerOptions& o) { o.resume = dir + "/state-00000009.hddp"; });
    });
    EXPECT_NE(message.find("state-00000009.hddp"), std::string::npos) << message;
  });
  // Restarted by a launcher (TORCHELASTIC_RESTART_COUNT > 0) without --resume: from the
  // newest state in saveDir, unless resumeOnRestart is off (then from step 0, saving 6).
  setenv("TORCHELASTIC_RESTART_COUNT", "1", 1);
  for (bool resumeOnRestart : {false, true}) {
    runThreads(1, [&](int rank, int size, hddp::Store& store) {
      auto s = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
        o.saveDir = dir + "/run";
        o.resumeOnRestart = resumeOnRestart;
        o.maxSteps = resumeOnRestart ? 8 : 6;
      });
      EXPECT_EQ(s.steps, resumeOnRestart ? 2 : 6);
      EXPECT_EQ(s.totalSteps, resumeOnRestart ? 8 : 6);
    });
  }
  unsetenv("TORCHELASTIC_RESTART_COUNT");
  // A folder whose every state file is damaged is not "empty": it is an error.
  for (const auto& f : hddp::listStateFiles(dir + "/run")) {
    std::fstream damaged(f, std::ios::in | std::ios::out | std::ios::binary);
    damaged.seekg(100);
    const char byte = static_cast<char>(damaged.get() ^ 0x5a);
    damaged.seekp(100);
    damaged.put(byte);
  }
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    const std::string message = stateError([&] {
      trainRun(rank, size, store, [&](hddp::TrainerOptions& o) { o.resume = dir + "/run"; });
    });
    EXPECT_NE(message.find("is valid"), std::string::npos) << message;
  });
}

// On a restart or re-forming, the newest commit in the save folder wins over the
// resume argument (`--resume pre`), which only starts a run whose save folder has none:
// resuming from `pre` again would train the committed steps a second time.
TEST(Trainer, ARestartResumesFromTheNewestCommitNotFromTheResumeArgument) {
  const std::string dir = hddp::testing::makeTempDir();
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.saveDir = dir + "/pre";
      o.maxSteps = 2;
    });
  });
  runThreads(1, [&](int rank, int size, hddp::Store& store) {  // the first start: from pre
    auto s = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.resume = dir + "/pre";
      o.saveDir = dir + "/run";
      o.saveEvery = 2;
      o.maxSteps = 6;
    });
    EXPECT_EQ(s.steps, 4);
  });
  setenv("TORCHELASTIC_RESTART_COUNT", "1", 1);
  runThreads(1, [&](int rank, int size, hddp::Store& store) {  // the restart: from step 6
    auto s = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.resume = dir + "/pre";
      o.saveDir = dir + "/run";
      o.saveEvery = 2;
      o.maxSteps = 8;
    });
    EXPECT_EQ(s.steps, 2) << "resumed from step " << s.totalSteps - s.steps;
    EXPECT_EQ(s.totalSteps, 8);
  });
  // A restart whose save folder has no commit yet starts from the resume argument.
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto s = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.resume = dir + "/pre";
      o.saveDir = dir + "/fresh";
      o.maxSteps = 4;
    });
    EXPECT_EQ(s.steps, 2);
  });
  unsetenv("TORCHELASTIC_RESTART_COUNT");
}

// A folder holding a file rank 0 cannot read (a step number too long for int64) is an
// error on every rank at once, not on rank 0 alone while the others wait for it.
TEST(Trainer, AStateFolderRankZeroCannotReadFailsEveryRankAtOnce) {
  const std::string dir = hddp::testing::makeTempDir();
  std::ofstream(dir + "/state-123456789012345678901234567890.hddp") << "x";
  std::vector<std::string> messages(2);
  const auto start = std::chrono::steady_clock::now();
  runThreads(
      2,
      [&](int rank, int size, hddp::Store& store) {
        try {
          trainRun(rank, size, store, [&](hddp::TrainerOptions& o) { o.resume = dir; });
        } catch (const c10::Error& e) {
          messages[rank] = e.what_without_backtrace();
        }
      },
      std::chrono::seconds(20));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(messages[rank].find("123456789012345678901234567890"), std::string::npos)
        << "rank " << rank << ": " << messages[rank];
  }
  EXPECT_LT(seconds, 10.0);
}

TEST(Trainer, CrossEntropyWithLabelSmoothingIsItsFormula) {
  torch::manual_seed(5);
  const auto logits = torch::randn({6, 5});
  const auto target = torch::randint(0, 5, {6}, torch::kLong);
  const double eps = 0.1;
  const auto logp = torch::log_softmax(logits, 1);
  // -(1 - eps) log p(target) - eps/K sum_k log p(k), averaged over the samples.
  const auto expected =
      (-(1 - eps) * logp.gather(1, target.unsqueeze(1)).squeeze(1) - eps / 5 * logp.sum(1)).mean();
  EXPECT_NEAR(hddp::crossEntropy(eps)(logits, target).item<double>(), expected.item<double>(),
              1e-6);
  EXPECT_NEAR(hddp::crossEntropy()(logits, target).item<double>(),
              -logp.gather(1, target.unsqueeze(1)).mean().item<double>(), 1e-6);
  EXPECT_THROW(hddp::crossEntropy(1.0), hddp::ConfigError);
}

TEST(Trainer, LearnsAndWritesMetricsAndTimeline) {
  const std::string dir = hddp::testing::makeTempDir();
  std::vector<hddp::TrainSummary> summaries(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    summaries[rank] = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.epochs = 6;
      o.metricsPath = dir + "/metrics.jsonl";
      o.timelinePath = dir + "/timeline.json";
    });
  });
  EXPECT_EQ(summaries[0].totalSteps, 24);
  std::vector<double> epochLoss;
  for (const char* name : {"metrics.jsonl", "metrics.rank1.jsonl"}) {
    std::ifstream in(dir + "/" + name);
    ASSERT_TRUE(in.good()) << name;
    std::string line;
    int steps = 0;
    int summariesSeen = 0;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line);
      const std::string kind = j.at("kind");
      if (kind == "step") {
        ++steps;
        for (const char* key : {"samples_per_s", "local_batch", "share", "data_wait_s", "compute_s",
                                "comm_wait_s", "loss", "loss_scale"}) {
          EXPECT_TRUE(j.contains(key)) << key;
        }
      } else if (kind == "epoch" && std::string(name) == "metrics.jsonl") {
        epochLoss.push_back(j.at("train_loss"));
      } else if (kind == "summary") {
        ++summariesSeen;
      }
    }
    EXPECT_EQ(steps, 24) << name;
    EXPECT_EQ(summariesSeen, 1) << name;
  }
  ASSERT_EQ(epochLoss.size(), 6u);
  EXPECT_LT(epochLoss.back(), 0.7 * epochLoss.front());
  std::ifstream in(dir + "/timeline.json");
  auto trace = nlohmann::json::parse(in);
  std::set<int> pids;
  std::set<std::string> names;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "X") {
      pids.insert(e.at("pid").get<int>());
      names.insert(e.at("name").get<std::string>());
    }
  }
  EXPECT_EQ(pids, (std::set<int>{0, 1}));
  for (const char* phase : {"data wait", "forward", "backward", "optimizer", "allreduce"}) {
    EXPECT_TRUE(names.count(phase)) << phase;
  }
}

// SyncBatchNorm runs collectives in forward: a rank with no samples would skip them and
// the others would wait forever. With a 10x slower rank (whose share would round to 0)
// and a last batch smaller than the number of ranks, every rank must still get a
// sample in every step, and every sample must still be used once per epoch.
TEST(Trainer, SyncBatchNormKeepsEveryRankInEveryStepDespiteASlowRankAndATinyLastBatch) {
  for (int world : {2, 3}) {
    const std::string dir = hddp::testing::makeTempDir();
    const int64_t B = 16;
    const int64_t N = 3 * B + world - 1;  // the last batch (world - 1) is below world
    const int epochs = 2;
    runThreads(world, [&](int rank, int size, hddp::Store& store) {
      auto comm = hddp::makeCommunicator(store, rank, size);
      SyncNet model;
      hddp::convertSyncBatchNorm(*model, *comm);  // attaches the communicator
      torch::optim::SGD opt(model->parameters(), 0.01);
      hddp::TrainerOptions o;
      o.globalBatch = B;
      o.epochs = epochs;
      o.progress = hddp::ProgressMode::Off;
      o.planner.rebalanceEvery = 2;
      o.metricsPath = dir + "/m.jsonl";
      hddp::EmulationOptions slow;
      slow.slowdown = rank == 1 ? 10.0 : 1.0;
      o.emulation = slow;
      auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(N, 1, 8, 4);
      hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt,
                            ds, o);
      trainer.fit();
    });
    int64_t samples = 0;
    int64_t steps = 0;
    for (int r = 0; r < world; ++r) {
      std::ifstream in(r == 0 ? dir + "/m.jsonl" : dir + "/m.rank" + std::to_string(r) + ".jsonl");
      for (std::string line; std::getline(in, line);) {
        auto rec = nlohmann::json::parse(line);
        if (rec.value("kind", "") != "step") {
          continue;
        }
        ++steps;
        samples += rec.at("local_batch").get<int64_t>();
        EXPECT_GE(rec.at("local_batch").get<int64_t>(), 1)
            << "world " << world << ", rank " << r << ": " << line;
      }
    }
    EXPECT_EQ(samples, epochs * N) << "world " << world;
    EXPECT_EQ(steps, world * epochs * 3) << "world " << world << ": the tiny rest joins a step";
  }
}

TEST(Trainer, PlannerGivesTheEmulatedSlowRankLess) {
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
    hddp::EmulationOptions slow;
    slow.slowdown = rank == 1 ? 4.0 : 1.0;
    o.emulation = slow;
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(640, 1, 8, 4);
    // Compute that grows with the batch, not with the shared CPU's load: 0.3 ms per
    // sample (a sleep) besides the tiny model.
    auto forward = [&model](const at::Tensor& x) {
      std::this_thread::sleep_for(std::chrono::microseconds(300 * x.size(0)));
      return model->forward(x);
    };
    hddp::Trainer trainer(*comm, model.ptr(), forward, hddp::crossEntropy(), opt, ds, o);
    trainer.fit();
    plans[rank] = trainer.planner()->plan().local;
  });
  EXPECT_EQ(plans[0], plans[1]);  // every rank derived the same plan
  EXPECT_GT(plans[0][0], 2 * plans[0][1]) << "plan [" << plans[0][0] << ", " << plans[0][1] << "]";
  // The planner's allgathers (after the 3 calibration steps, then every 3) are on the
  // communication track of the timeline, for every rank.
  std::ifstream in(dir + "/timeline.json");
  auto trace = nlohmann::json::parse(in);
  std::map<int, int> exchanges;
  std::map<int, double> firstStepDelay;  // emulated microseconds in step 0, per rank
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "X" && e.at("name") == "plan exchange") {
      ++exchanges[e.at("pid").get<int>()];
    }
    if (e.at("ph") == "X" && e.at("name") == "emulated delay" && e.at("args").at("step") == 0) {
      firstStepDelay[e.at("pid").get<int>()] += e.at("dur").get<double>();
    }
  }
  EXPECT_EQ(exchanges, (std::map<int, int>{{0, 4}, {1, 4}}));
  // The slow rank is slowed from its first step on (stretched after the fact, there
  // being no estimate before it), so the calibration sees its emulated speed.
  EXPECT_GT(firstStepDelay[1], 100.0);
  EXPECT_EQ(firstStepDelay.count(0), 0u);
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

TEST(Trainer, RefusesBadOptions) {
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto bad = [&](const std::function<void(hddp::TrainerOptions&)>& configure) {
      try {
        trainRun(rank, size, store, configure);
      } catch (const hddp::ConfigError& e) {
        return std::string(e.what_without_backtrace());
      }
      return std::string("(no ConfigError)");
    };
    EXPECT_NE(bad([](hddp::TrainerOptions& o) { o.amp = hddp::AmpMode::Fp16; }).find("needs a GPU"),
              std::string::npos);
    EXPECT_NE(bad([](hddp::TrainerOptions& o) { o.saveEvery = 5; }).find("saveDir"),
              std::string::npos);
    EXPECT_NE(bad([](hddp::TrainerOptions& o) { o.keepLast = 0; }).find("keepLast"),
              std::string::npos);
    // Given memory caps: one per rank, and with the equal split the share must fit.
    EXPECT_NE(bad([](hddp::TrainerOptions& o) {
                o.maxLocalBatch = {8, 8};
              }).find("maxLocalBatch has 2 entries for 1 ranks"),
              std::string::npos);
    EXPECT_NE(bad([](hddp::TrainerOptions& o) {
                o.maxLocalBatch = {8};
              }).find("equal share of the global batch 24 is 24"),
              std::string::npos);
    EXPECT_NE(bad([](hddp::TrainerOptions& o) {
                o.balance = true;
                o.maxLocalBatch = {8};
              }).find("fewer than the global batch 24"),
              std::string::npos);
  });
  EXPECT_THROW(hddp::parseAmpMode("fp8"), hddp::ConfigError);
  EXPECT_EQ(hddp::parseAmpMode("bf16"), hddp::AmpMode::Bf16);
}

namespace {

// A linear classifier whose weight is also registered under a second name when `tie`
// is set: LibTorch's parameters() then lists that tensor twice.
struct TiedNetImpl : torch::nn::Module {
  explicit TiedNetImpl(bool tie) {
    fc = register_module("fc", torch::nn::Linear(64, 4));
    if (tie) {
      register_parameter("alias", fc->weight);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc->forward(x.flatten(1)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(TiedNet);

}  // namespace

// Gradient clipping counts a tied weight once (PyTorch de-duplicates; a weight counted
// twice inflates the norm and shrinks the clipped step): one step with clipping on the
// tied model equals the same model with the weight registered once. An optimizer
// built from parameters() of the tied model, which would step the weight twice, is
// refused with the fix in the message.
TEST(Trainer, ClippingCountsATiedWeightOnceAndAnOptimizerListingItTwiceIsRefused) {
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(48, 1, 8, 4, /*seed=*/1);
    hddp::TrainerOptions o;
    o.globalBatch = 24;
    o.maxSteps = 1;
    o.balance = false;
    o.clipGradNorm = 0.05;  // well under the gradient's norm: clipping acts
    o.progress = hddp::ProgressMode::Off;
    o.loader.workers = 0;
    auto train = [&](bool tie) {
      torch::manual_seed(11);
      TiedNet model(tie);
      torch::optim::SGD opt(hddp::uniqueParameters(*model), torch::optim::SGDOptions(1.0));
      hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt,
                            ds, o);
      trainer.fit();
      return model->fc->weight.detach().clone();
    };
    const auto once = train(false);
    const auto tied = train(true);
    EXPECT_TRUE(torch::allclose(once, tied, 1e-6, 1e-7))
        << "max diff " << (once - tied).abs().max().item<double>();
    torch::manual_seed(11);
    TiedNet model(true);
    torch::optim::SGD twice(model->parameters(), torch::optim::SGDOptions(1.0));
    try {
      hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), twice,
                            ds, o);
      ADD_FAILURE() << "an optimizer listing a tied weight twice was accepted";
    } catch (const hddp::ConfigError& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find("uniqueParameters"), std::string::npos) << message;
      EXPECT_NE(message.find("'alias'"), std::string::npos) << message;
    }
  });
}

// A memory cap given at resume (--max-local-batch) wins over the saved state, and the
// saved plan that breaks it is re-solved at once (the restore used to put the saved
// caps back, and rank 1 trained on 12 samples with a cap of 8 given).
TEST(Trainer, CapsGivenAtResumeWinOverTheSavedOnes) {
  const std::string dir = hddp::testing::makeTempDir();
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.balance = true;
      o.epochs = 10;
      o.maxSteps = 12;
      o.saveDir = dir;
    });
  });
  std::vector<std::vector<int64_t>> plans(2), caps(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    Net model;
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
    hddp::TrainerOptions o;
    o.globalBatch = 24;
    o.epochs = 10;
    o.progress = hddp::ProgressMode::Off;
    o.loader.workers = 0;
    o.maxLocalBatch = {0, 8};
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(80, 1, 8, 4, /*seed=*/1);
    hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt, ds,
                          o);
    trainer.load(dir);
    plans[rank] = trainer.planner()->plan().local;
    caps[rank] = trainer.planner()->memoryCaps();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(plans[r].size(), 2u);
    EXPECT_LE(plans[r][1], 8) << "rank " << r;
    EXPECT_EQ(plans[r][0] + plans[r][1], 24);
    EXPECT_EQ(caps[r][1], 8) << "rank " << r;
  }
}

// A resume reports the epoch it continues as a whole: its training loss is over all
// its steps, those before the save included (the state carries the epoch's sums), and
// a run that stops at an epoch's last step ends that epoch (evaluation, state at the
// boundary), so the resumed run neither reports an empty epoch nor evaluates it again.
TEST(Trainer, AResumedEpochReportsAllItsStepsAndAnEndedEpochIsNotRepeated) {
  const std::string dir = hddp::testing::makeTempDir();
  hddp::TrainSummary straight, resumed, second;
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    straight = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) { o.epochs = 2; });
    // Mid-epoch: 80 samples in steps of 24 are 4 steps per epoch; stop after 1.
    trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.epochs = 1;
      o.maxSteps = 1;
      o.saveDir = dir + "/mid";
    });
    resumed = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.epochs = 1;
      o.resume = dir + "/mid";
    });
    // At the epoch's last step: the epoch ends there, and the resumed run trains epoch 2.
    const auto first = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.epochs = 2;
      o.maxSteps = 4;
      o.saveDir = dir + "/end";
    });
    EXPECT_EQ(first.epochsCompleted, 1);
    second = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.epochs = 2;
      o.resume = dir + "/end";
    });
  });
  EXPECT_EQ(resumed.steps, 3);
  EXPECT_NE(resumed.lastTrainLoss, 0.0);
  // Epoch 1's loss of the straight run is not known from its summary (it reports the
  // last epoch); the one-epoch resumed run must match a one-epoch straight run.
  hddp::TrainSummary oneEpoch;
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    oneEpoch = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) { o.epochs = 1; });
  });
  EXPECT_NEAR(resumed.lastTrainLoss, oneEpoch.lastTrainLoss,
              1e-5 * std::abs(oneEpoch.lastTrainLoss));
  EXPECT_EQ(second.epochsCompleted, 1) << "an empty epoch 1 was reported again";
  EXPECT_EQ(second.steps, 4);
  EXPECT_NEAR(second.lastTrainLoss, straight.lastTrainLoss,
              1e-5 * std::abs(straight.lastTrainLoss));
}

// A commit due at the epoch's last step (--save-every 4 with 4 steps per epoch) is
// saved once, as the epoch's end, not once as a commit and again at the epoch's end.
// And a restart of a job appends to its metrics file, also when it found no commit.
TEST(Trainer, ACommitAtTheEpochsEndIsSavedOnceAndARestartAppendsToTheMetrics) {
  const std::string dir = hddp::testing::makeTempDir();
  std::mutex mu;
  std::vector<std::string> saved;
  const hddp::log::Level level = hddp::log::level();
  hddp::log::setLevel(hddp::log::Level::Info);
  hddp::log::setLineHandler([&](hddp::log::Level, const std::string& line) {
    if (line.find("saved step") != std::string::npos) {
      std::lock_guard<std::mutex> lock(mu);
      saved.push_back(line);
    }
  });
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.epochs = 1;
      o.saveEvery = 4;  // 80 samples in steps of 24: 4 steps, the last one of 8
      o.saveDir = dir + "/state";
      o.metricsPath = dir + "/metrics.jsonl";
    });
  });
  hddp::log::setLineHandler(nullptr);
  hddp::log::setLevel(level);
  EXPECT_EQ(saved.size(), 1u) << (saved.empty() ? std::string() : saved.back());
  auto lines = [&] {
    std::ifstream in(dir + "/metrics.jsonl");
    int n = 0;
    for (std::string line; std::getline(in, line);) {
      n += line.empty() ? 0 : 1;
    }
    return n;
  };
  const int first = lines();
  ASSERT_GT(first, 0);
  setenv("TORCHELASTIC_RESTART_COUNT", "1", 1);
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      o.epochs = 1;
      o.maxSteps = 2;
      o.saveDir = dir + "/no-commits-yet";
      o.metricsPath = dir + "/metrics.jsonl";
    });
  });
  unsetenv("TORCHELASTIC_RESTART_COUNT");
  EXPECT_GT(lines(), first) << "the restart truncated the job's metrics file";
}
