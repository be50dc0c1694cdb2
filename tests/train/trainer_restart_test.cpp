// Where a run resumes from and what a resume keeps: a corrupt state file in a folder, an
// empty or missing folder, a launcher's restart (from the newest commit, not from the
// resume argument), a folder rank 0 cannot read; memory caps given at resume, the epoch
// a resume continues, a commit at an epoch's end, and the metrics file of a restart.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/data/datasets.h"
#include "hddp/train/state_file.h"
#include "hddp/train/trainer.h"
#include "support/ranks.h"
#include "support/trainer_runs.h"

namespace fs = std::filesystem;
using hddp::testing::Net;
using hddp::testing::runThreads;
using hddp::testing::stateError;
using hddp::testing::trainRun;

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
