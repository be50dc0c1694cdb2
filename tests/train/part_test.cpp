// The Trainer's parts of a program's own (hddp/train/part.h): the hooks on every rank in
// the loop's order, requests made on one rank holding on every rank, hook failures ending
// fit() on every rank, the parts' states in state files, and the names checked.
#include "hddp/train/part.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/data/datasets.h"
#include "hddp/train/state_file.h"
#include "hddp/train/trainer.h"
#include "support/disk.h"
#include "support/ranks.h"

using hddp::testing::runThreads;

namespace {

// Writes down each hook as it is called; asks to stop or save at given steps (0-based
// step index of the step that just ended; -1: never), on this rank only.
class Recorder final : public hddp::TrainerPart {
 public:
  explicit Recorder(std::string name = "recorder") : name_(std::move(name)) {}
  std::string name() const override { return name_; }
  void onFitStart(hddp::Communicator&, const hddp::FitStart& s) override {
    log.push_back("start " + std::to_string(s.step) + (s.resumed ? " resumed" : ""));
  }
  void beforeStep(const hddp::StepInfo& i) override {
    log.push_back("before " + std::to_string(i.step));
    if (i.step == throwAt) {
      throw hddp::DataError("the part met bad data at step " + std::to_string(i.step));
    }
  }
  void afterBackward(const hddp::StepInfo& i) override {
    log.push_back("backward " + std::to_string(i.step));
  }
  void afterOptimizerStep(const hddp::StepEnd& e, hddp::LoopRequests& r) override {
    log.push_back("optimizer " + std::to_string(e.info.step));
    losses.push_back(e.loss);
    if (e.info.step == stopAt) {
      r.stop("enough at step " + std::to_string(e.info.step));
    }
    if (e.info.step == saveAt) {
      r.save();
    }
  }
  void onEpochEnd(const hddp::EpochSummary& e, hddp::LoopRequests& r) override {
    log.push_back("epoch " + std::to_string(e.epoch) + " " + std::to_string(e.steps));
    if (e.epoch == stopAfterEpoch) {
      r.stop("enough epochs");
    }
  }
  void onFitEnd(const hddp::TrainSummary& s) override {
    log.push_back("end " + std::to_string(s.totalSteps));
  }
  bool agreesEachStep() const override { return eachStep; }
  int stateVersion() const override { return version; }
  std::string saveState() const override {
    if (refuseSave) {
      throw hddp::Error("the part cannot give its state");
    }
    return std::to_string(counter);
  }
  void loadState(const std::string& bytes, int v) override {
    if (refuse) {
      throw hddp::StateError("the part refuses '" + bytes + "'");
    }
    counter = std::stoll(bytes);
    loadedVersion = v;
  }

  std::string name_;
  std::vector<std::string> log;
  std::vector<double> losses;
  int64_t stopAt = -1;
  int64_t saveAt = -1;
  int64_t throwAt = -1;
  int64_t stopAfterEpoch = -1;
  int version = 0;
  int64_t counter = 0;
  int loadedVersion = 0;
  bool refuse = false;
  bool refuseSave = false;
  bool eachStep = false;
};

struct Job {
  std::unique_ptr<hddp::Communicator> comm;
  torch::nn::Sequential model{torch::nn::Flatten(), torch::nn::Linear(64, 4)};
  std::unique_ptr<torch::optim::SGD> opt;
  std::unique_ptr<hddp::Trainer> trainer;
};

// Two epochs of 4 steps (128 samples, global batch 32) on `size` ranks.
std::unique_ptr<Job> makeJob(int rank, int size, hddp::Store& store,
                             const std::function<void(hddp::TrainerOptions&)>& configure = {}) {
  auto job = std::make_unique<Job>();
  hddp::CommunicatorOptions co;
  co.timeout = std::chrono::seconds(60);  // a rank left waiting fails, not hangs
  job->comm = hddp::makeCommunicator(store, rank, size, co);
  torch::manual_seed(3);
  job->model = torch::nn::Sequential(torch::nn::Flatten(), torch::nn::Linear(64, 4));
  job->opt = std::make_unique<torch::optim::SGD>(job->model->parameters(), 0.05);
  hddp::TrainerOptions o;
  o.globalBatch = 32;
  o.epochs = 2;
  o.balance = false;
  o.progress = hddp::ProgressMode::Off;
  o.loader.workers = 0;
  if (configure) {
    configure(o);
  }
  auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(128, 1, 8, 4);
  job->trainer =
      std::make_unique<hddp::Trainer>(*job->comm, job->model.ptr(), hddp::forwardOf(job->model),
                                      hddp::crossEntropy(), *job->opt, ds, o);
  return job;
}

// A fresh folder of the test's own (`what` says what for, to the reader).
std::string tempDir(const std::string& what) {
  (void)what;
  return hddp::testing::makeTempDir();
}

TEST(TrainerParts, HooksRunOnEveryRankInTheLoopsOrder) {
  std::vector<std::vector<std::string>> logs(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto job = makeJob(rank, size, store);
    auto part = std::make_shared<Recorder>();
    job->trainer->addPart(part);
    job->trainer->fit();
    logs[static_cast<size_t>(rank)] = part->log;
    EXPECT_EQ(part->losses.size(), 8u);
    for (double loss : part->losses) {
      EXPECT_GT(loss, 0.0);  // each rank's share's mean cross-entropy
    }
  });
  std::vector<std::string> expected{"start 0"};
  for (int epoch = 0; epoch < 2; ++epoch) {
    for (int i = 0; i < 4; ++i) {
      const std::string s = std::to_string(epoch * 4 + i);
      expected.insert(expected.end(), {"before " + s, "backward " + s, "optimizer " + s});
    }
    expected.push_back("epoch " + std::to_string(epoch) + " 4");
  }
  expected.push_back("end 8");
  EXPECT_EQ(logs[0], expected);
  EXPECT_EQ(logs[1], expected);
}

TEST(TrainerParts, AStopAskedOnOneRankEndsTheRunOnEveryRankAtThatStep) {
  std::vector<int64_t> steps(2);
  std::vector<bool> early(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto job = makeJob(rank, size, store);
    auto part = std::make_shared<Recorder>();
    part->stopAt = rank == 1 ? 5 : -1;  // the 6th step, inside the second epoch
    part->eachStep = true;
    job->trainer->addPart(part);
    const auto summary = job->trainer->fit();
    steps[static_cast<size_t>(rank)] = summary.totalSteps;
    early[static_cast<size_t>(rank)] = job->trainer->stoppedEarly();
  });
  EXPECT_EQ(steps, (std::vector<int64_t>{6, 6}));
  EXPECT_TRUE(early[0] && early[1]);
}

TEST(TrainerParts, AStopAskedAtAnEpochsEndEndsTheRunThere) {
  std::vector<int64_t> steps(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto job = makeJob(rank, size, store, [](hddp::TrainerOptions& o) { o.epochs = 3; });
    auto part = std::make_shared<Recorder>();
    part->stopAfterEpoch = rank == 0 ? 0 : -1;
    job->trainer->addPart(part);
    steps[static_cast<size_t>(rank)] = job->trainer->fit().totalSteps;
    EXPECT_TRUE(job->trainer->stoppedEarly());
    EXPECT_EQ(job->trainer->epoch(), 1);
  });
  EXPECT_EQ(steps, (std::vector<int64_t>{4, 4}));
}

TEST(TrainerParts, ASaveAskedOnOneRankCommitsTheStepOnEveryRank) {
  const std::string dir = tempDir("hddp-part-save");
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto job = makeJob(rank, size, store, [&](hddp::TrainerOptions& o) { o.saveDir = dir; });
    auto part = std::make_shared<Recorder>();
    part->saveAt = rank == 1 ? 1 : -1;  // after the 2nd step
    part->eachStep = true;
    job->trainer->addPart(part);
    job->trainer->fit();
  });
  EXPECT_TRUE(std::filesystem::exists(hddp::stateFileName(dir, 2)));
  hddp::testing::removeTree(dir);
}

TEST(TrainerParts, ASaveAskedWithoutASaveFolderIsAConfigErrorOnEveryRank) {
  std::vector<std::string> errors(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto job = makeJob(rank, size, store);
    auto part = std::make_shared<Recorder>();
    part->saveAt = rank == 0 ? 2 : -1;
    part->eachStep = true;
    job->trainer->addPart(part);
    try {
      job->trainer->fit();
    } catch (const hddp::ConfigError& e) {
      errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("no save folder"), std::string::npos) << e;
  }
}

TEST(TrainerParts, AHookThatThrowsOnOneRankEndsFitOnEveryRank) {
  std::vector<std::string> errors(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto job = makeJob(rank, size, store);
    auto part = std::make_shared<Recorder>();
    part->throwAt = rank == 1 ? 2 : -1;
    part->eachStep = true;
    job->trainer->addPart(part);
    try {
      job->trainer->fit();
    } catch (const hddp::Error& e) {
      errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
    }
    EXPECT_EQ(job->trainer->step(), 3);  // the step went on; the run ended after it
  });
  EXPECT_NE(errors[1].find("bad data at step 2"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0].find("failed on rank 1"), std::string::npos) << errors[0];
}

// Without agreesEachStep() nothing is agreed per step: a stop asked at the second step
// and a hook's exception act at the epoch's end, on every rank, of the same kind.
TEST(TrainerParts, WithoutAgreementEachStepRequestsAndFailuresActAtTheEpochsEnd) {
  std::vector<int64_t> steps(2);
  std::vector<std::string> kinds(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    {
      auto job = makeJob(rank, size, store);
      auto part = std::make_shared<Recorder>();
      part->stopAt = rank == 1 ? 1 : -1;
      job->trainer->addPart(part);
      steps[static_cast<size_t>(rank)] = job->trainer->fit().totalSteps;
      EXPECT_TRUE(job->trainer->stoppedEarly());
    }
    auto job = makeJob(rank, size, store);
    auto part = std::make_shared<Recorder>();
    part->throwAt = rank == 0 ? 1 : -1;  // a DataError on rank 0
    job->trainer->addPart(part);
    try {
      job->trainer->fit();
    } catch (const hddp::DataError&) {
      kinds[static_cast<size_t>(rank)] = "DataError";
    } catch (const hddp::Error&) {
      kinds[static_cast<size_t>(rank)] = "Error";
    }
    EXPECT_EQ(job->trainer->step(), 4);  // the first epoch ran to its end
  });
  EXPECT_EQ(steps, (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(kinds, (std::vector<std::string>{"DataError", "DataError"}));
}

TEST(TrainerParts, DifferentPartsOnTheRanksAreAConfigErrorOnEveryRank) {
  std::vector<std::string> errors(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto job = makeJob(rank, size, store);
    job->trainer->addPart(std::make_shared<Recorder>(rank == 0 ? "ema" : "early_stop"));
    try {
      job->trainer->fit();
    } catch (const hddp::ConfigError& e) {
      errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
    }
    EXPECT_EQ(job->trainer->step(), 0);
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("parts differ between ranks"), std::string::npos) << e;
    EXPECT_NE(e.find("early_stop"), std::string::npos) << e;
  }
}

// Each copy of a commit holds rank 0's part states: with a save folder per rank, the copy
// rank 1 writes too. A part that cannot give its state fails the save on every rank.
TEST(TrainerParts, EveryCopyOfACommitHoldsRankZerosPartStatesAndAFailedStateFailsTheSave) {
  const std::string dir = tempDir("hddp-part-folders");
  std::vector<std::string> errors(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    {
      auto job = makeJob(rank, size, store, [&](hddp::TrainerOptions& o) {
        o.saveDir = dir + "/rank" + std::to_string(rank);
        o.epochs = 1;
      });
      auto part = std::make_shared<Recorder>("counter");
      part->version = 1;
      part->counter = 40 + rank;
      job->trainer->addPart(part);
      job->trainer->fit();
      part->refuseSave = rank == 0;
      try {
        job->trainer->save();
      } catch (const hddp::StateError& e) {
        errors[static_cast<size_t>(rank)] = e.what_without_backtrace();
      }
    }
    auto job = makeJob(rank, size, store);
    auto part = std::make_shared<Recorder>("counter");
    part->version = 1;
    job->trainer->addPart(part);
    job->trainer->load(hddp::stateFileName(dir + "/rank1", 4));  // rank 1's copy
    EXPECT_EQ(part->counter, 40);
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("cannot give its state"), std::string::npos) << e;
  }
  hddp::testing::removeTree(dir);
}

TEST(TrainerParts, NamesAreCheckedWhenAdded) {
  runThreads(1, [&](int rank, int size, hddp::Store& store) {
    auto job = makeJob(rank, size, store);
    EXPECT_THROW(job->trainer->addPart(nullptr), hddp::ConfigError);
    EXPECT_THROW(job->trainer->addPart(std::make_shared<Recorder>("")), hddp::ConfigError);
    EXPECT_THROW(job->trainer->addPart(std::make_shared<Recorder>("a b")), hddp::ConfigError);
    EXPECT_THROW(job->trainer->addPart(std::make_shared<Recorder>(std::string(65, 'a'))),
                 hddp::ConfigError);
    job->trainer->addPart(std::make_shared<Recorder>("ema-2_b"));
    EXPECT_THROW(job->trainer->addPart(std::make_shared<Recorder>("ema-2_b")), hddp::ConfigError);
  });
}

// A part's state goes into the state file and comes back at a resume; a file without it
// leaves the part as it is; a newer version is refused before anything changes; a part
// that refuses its bytes fails the load on every rank and the part loaded before it is
// put back.
TEST(TrainerParts, APartsStateIsSavedAndLoadedByItsVersion) {
  const std::string dir = tempDir("hddp-part-state");
  const std::string plain = tempDir("hddp-part-plain");
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    {
      auto job = makeJob(rank, size, store, [&](hddp::TrainerOptions& o) { o.saveDir = dir; });
      auto part = std::make_shared<Recorder>("counter");
      part->version = 2;
      part->counter = 40 + rank;  // rank 0 writes the file: 40
      job->trainer->addPart(part);
      job->trainer->addPart(std::make_shared<Recorder>("stateless"));
      auto other = std::make_shared<Recorder>("other");
      other->version = 1;
      other->counter = 9;
      job->trainer->addPart(other);
      job->trainer->fit();
    }
    {
      auto job = makeJob(rank, size, store, [&](hddp::TrainerOptions& o) { o.saveDir = plain; });
      job->trainer->fit();  // a file without parts
    }
    const std::string file = hddp::stateFileName(dir, 8);
    {  // resumed: the saved state, at its version
      auto job = makeJob(rank, size, store);
      auto part = std::make_shared<Recorder>("counter");
      part->version = 3;
      job->trainer->addPart(part);
      job->trainer->load(file);
      EXPECT_EQ(part->counter, 40);
      EXPECT_EQ(part->loadedVersion, 2);
    }
    {  // a file without the part: it keeps its own
      auto job = makeJob(rank, size, store);
      auto part = std::make_shared<Recorder>("counter");
      part->version = 1;
      part->counter = 7;
      job->trainer->addPart(part);
      job->trainer->load(hddp::stateFileName(plain, 8));
      EXPECT_EQ(part->counter, 7);
      EXPECT_EQ(job->trainer->step(), 8);
    }
    {  // saved at version 2, read by a part of version 1: refused, nothing changed
      auto job = makeJob(rank, size, store);
      auto part = std::make_shared<Recorder>("counter");
      part->version = 1;
      part->counter = 7;
      job->trainer->addPart(part);
      try {
        job->trainer->load(file);
        ADD_FAILURE() << "a newer version of the part's state loaded";
      } catch (const hddp::StateError& e) {
        EXPECT_NE(std::string(e.what()).find("at version 2"), std::string::npos) << e.what();
      }
      EXPECT_EQ(part->counter, 7);
      EXPECT_EQ(job->trainer->step(), 0);
      job->trainer->fit();  // the Trainer goes on as it was
    }
    {  // the second part refuses (on rank 1 only): the first is put back on every rank
      auto job = makeJob(rank, size, store);
      auto first = std::make_shared<Recorder>("counter");
      first->version = 2;
      first->counter = 5;
      auto second = std::make_shared<Recorder>("other");
      second->version = 1;
      second->counter = 6;
      second->refuse = rank == 1;
      job->trainer->addPart(first);
      job->trainer->addPart(second);
      try {
        job->trainer->load(file);
        ADD_FAILURE() << "a refused part's state loaded";
      } catch (const hddp::StateError& e) {
        EXPECT_NE(std::string(e.what()).find(rank == 1 ? "refuses '9'" : "rank 1"),
                  std::string::npos)
            << e.what();
      }
      EXPECT_EQ(first->counter, 5);
      EXPECT_EQ(second->counter, 6);
      EXPECT_EQ(job->trainer->step(), 0);
      second->refuse = false;
      job->trainer->load(file);  // not half loaded: a load goes through now
      EXPECT_EQ(first->counter, 40);
      EXPECT_EQ(second->counter, 9);
    }
  });
  hddp::testing::removeTree(dir);
  hddp::testing::removeTree(plain);
}

}  // namespace
