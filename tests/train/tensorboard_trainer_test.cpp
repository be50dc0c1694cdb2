// The Trainer's TensorBoard on several ranks: a folder rank 0 cannot write, a full disk
// mid-run, the learning rate of any optimizer, a step without samples on rank 0; and
// without protobuf, a folder refused on every rank. (The event-file format and the
// writer are tests/train/tensorboard_test.cpp's.)
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/data/datasets.h"
#include "hddp/train/tensorboard.h"
#include "hddp/train/trainer.h"
#include "support/disk.h"
#include "support/event_records.h"
#include "support/ranks.h"

#if HDDP_TEST_TENSORBOARD
#include "train/reporter.h"
#endif

namespace {

using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> params)>;

// One rank of a small Trainer run (a linear classifier on 8x8 synthetic images, 4 steps
// an epoch, SGD unless `makeOptimizer` is given) whose collectives give up after 30 s,
// so that a rank left waiting fails the test instead of hanging it.
hddp::TrainSummary trainLinear(int rank, int size, hddp::Store& store,
                               const std::function<void(hddp::TrainerOptions&)>& configure,
                               const OptimizerFactory& makeOptimizer = nullptr) {
  hddp::CommunicatorOptions co;
  co.timeout = std::chrono::seconds(30);
  auto comm = hddp::makeCommunicator(store, rank, size, co);
  torch::manual_seed(7);
  torch::nn::Sequential model(torch::nn::Flatten(), torch::nn::Linear(64, 4));
  std::unique_ptr<torch::optim::Optimizer> optimizer =
      makeOptimizer ? makeOptimizer(model->parameters())
                    : std::make_unique<torch::optim::SGD>(model->parameters(),
                                                          torch::optim::SGDOptions(0.05));
  hddp::TrainerOptions o;
  o.globalBatch = 24;
  o.epochs = 2;
  o.balance = false;
  o.progress = hddp::ProgressMode::Off;
  o.loader.workers = 0;
  configure(o);
  auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(80, 1, 8, 4, /*seed=*/1);
  hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(),
                        *optimizer, ds, o);
  return trainer.fit();
}

#if HDDP_TEST_TENSORBOARD

using hddp::testing::FileSizeLimit;
using hddp::testing::removeTree;
using hddp::testing::event_records::asFloat;
using hddp::testing::event_records::checkedRecords;
using hddp::testing::event_records::eventFiles;
using hddp::testing::event_records::field;
using hddp::testing::event_records::Field;
using hddp::testing::event_records::fields;
using hddp::testing::event_records::hasField;

// Gradient descent with options of its own: an optimizer LibTorch does not ship. With
// `kKnowsItsRate` its options override get_lr()/set_lr(), as LibTorch's own do; without,
// they keep OptimizerOptions' (which throw).
template <bool kKnowsItsRate>
struct PlainDescentOptions
    : torch::optim::OptimizerCloneableOptions<PlainDescentOptions<kKnowsItsRate>> {
  explicit PlainDescentOptions(double rate) : rate(rate) {}
  double rate;
};

template <>
struct PlainDescentOptions<true>
    : torch::optim::OptimizerCloneableOptions<PlainDescentOptions<true>> {
  explicit PlainDescentOptions(double rate) : rate(rate) {}
  double get_lr() const override { return rate; }
  void set_lr(const double lr) override { rate = lr; }
  double rate;
};

template <bool kKnowsItsRate>
class PlainDescent : public torch::optim::Optimizer {
 public:
  PlainDescent(std::vector<at::Tensor> params, double rate)
      : Optimizer(std::move(params), std::make_unique<PlainDescentOptions<kKnowsItsRate>>(rate)) {}
  at::Tensor step(LossClosure = nullptr) override {
    torch::NoGradGuard noGrad;
    for (auto& group : param_groups()) {
      const double rate = static_cast<PlainDescentOptions<kKnowsItsRate>&>(group.options()).rate;
      for (auto& p : group.params()) {
        if (p.grad().defined()) {
          p.add_(p.grad(), -rate);
        }
      }
    }
    return {};
  }
};

// The scalars of `tag` in a folder's event files, as (step, value). Stricter than
// event_records::scalarValuesIn, which reads by the lengths alone: every record's CRCs
// are checked and each field must be there once, so a file cut short by a failed write
// must still hold whole records only.
std::vector<std::pair<int64_t, float>> scalarsIn(const std::string& dir, const std::string& tag) {
  std::vector<std::pair<int64_t, float>> out;
  for (const std::string& name : eventFiles(dir)) {
    for (const std::string& e : checkedRecords(dir + "/" + name)) {
      if (!hasField(e, 5)) {
        continue;
      }
      for (const Field& v : fields(field(e, 5).bytes)) {
        if (v.number == 1 && field(v.bytes, 1).bytes == tag && hasField(v.bytes, 2)) {
          out.emplace_back(static_cast<int64_t>(field(e, 2).value),
                           asFloat(field(v.bytes, 2).value));
        }
      }
    }
  }
  return out;
}

// Rank 0 alone writes TensorBoard: a folder it cannot make (here one under a regular
// file, which stops root too) fails fit() on every rank at once, each with a
// ConfigError that names the folder, instead of leaving rank 1 in the next collective
// until its timeout (30 s here, 30 min by default).
TEST(TrainerTensorBoard, AFolderRank0CannotMakeFailsEveryRankAtOnce) {
  const std::string dir = hddp::testing::makeTempDir();
  std::ofstream(dir + "/a_file") << "not a folder";
  const std::string folder = dir + "/a_file/runs";
  std::vector<std::string> errors(2, "(no ConfigError)");
  const auto start = std::chrono::steady_clock::now();
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    try {
      trainLinear(rank, size, store, [&](hddp::TrainerOptions& o) { o.tensorboard = folder; });
    } catch (const hddp::ConfigError& e) {
      errors[rank] = e.what_without_backtrace();
    } catch (const std::exception& e) {
      errors[rank] = std::string("not a ConfigError: ") + e.what();
    }
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(errors[0].find("cannot create the TensorBoard folder " + folder), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("opening the output files at the start of fit() failed on rank 0: "
                           "hddp: cannot create the TensorBoard folder " +
                           folder),
            std::string::npos)
      << errors[1];
  // A ConfigError on both ranks, not a TimeoutError: rank 1 did not wait for rank 0. The
  // time is for the log only (no test requires a speed).
  std::cout << "both ranks failed in " << seconds << " s\n";
  removeTree(dir);
}

// A disk that fills up mid-run (the file size limit, RLIMIT_FSIZE): rank 0 logs an error
// naming the file, writes no more TensorBoard records, and both ranks train to the end
// (a throw on rank 0 alone would leave rank 1 in the next collective). The file keeps
// the whole records written before the failure.
TEST(TrainerTensorBoard, AWriteThatFailsMidRunStopsTensorBoardNotTheRun) {
  const std::string dir = hddp::testing::makeTempDir() + "/tb";
  std::mutex mutex;
  std::vector<std::string> errorLines;
  hddp::log::setLineHandler([&](hddp::log::Level level, const std::string& line) {
    if (level >= hddp::log::Level::Error) {
      std::lock_guard<std::mutex> lock(mutex);
      errorLines.push_back(line);
    }
  });
  std::vector<hddp::TrainSummary> summaries(2);
  std::vector<std::string> errors(2);
  {
    // ~1 KB a step: the limit falls within the run's 8 steps. No other file grows.
    const FileSizeLimit full(3000);
    hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
      try {
        summaries[rank] =
            trainLinear(rank, size, store, [&](hddp::TrainerOptions& o) { o.tensorboard = dir; });
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  hddp::log::setLineHandler(nullptr);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(summaries[r].totalSteps, 8) << "rank " << r;
  }
  const auto files = eventFiles(dir);
  ASSERT_EQ(files.size(), 1u);
  const std::string path = dir + "/" + files[0];
  ASSERT_EQ(errorLines.size(), 1u) << "one error, then TensorBoard is off";
  EXPECT_NE(errorLines[0].find("TENSORBOARD OUTPUT STOPS HERE: hddp: cannot write the "
                               "TensorBoard event file " +
                               path),
            std::string::npos)
      << errorLines[0];
  EXPECT_NE(errorLines[0].find("training goes on"), std::string::npos) << errorLines[0];
  const auto losses = scalarsIn(dir, "train/loss");  // whole records only
  ASSERT_FALSE(losses.empty());
  EXPECT_LT(losses.back().first, 8);
  removeTree(std::filesystem::path(dir).parent_path().string());
}

// train/lr is the first group's rate by its options' get_lr(): written for an optimizer
// LibTorch does not ship (following the schedule, which sets it through set_lr), and
// left out, without failing the run, for one whose options do not implement it.
TEST(TrainerTensorBoard, TheLearningRateOfAnyOptimizerThatKnowsItIsWritten) {
  const std::string dir = hddp::testing::makeTempDir();
  const auto schedule = [](const hddp::StepInfo& info, torch::optim::Optimizer& optimizer) {
    hddp::setLearningRate(optimizer, 0.5 / static_cast<double>(info.step + 1));
  };
  hddp::testing::runThreads(1, [&](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions co;
    auto comm = hddp::makeCommunicator(store, rank, size, co);
    for (const bool knowsItsRate : {true, false}) {
      torch::nn::Sequential model(torch::nn::Flatten(), torch::nn::Linear(64, 4));
      std::unique_ptr<torch::optim::Optimizer> optimizer;
      if (knowsItsRate) {
        optimizer = std::make_unique<PlainDescent<true>>(model->parameters(), 0.5);
      } else {
        optimizer = std::make_unique<PlainDescent<false>>(model->parameters(), 0.5);
      }
      hddp::TrainerOptions o;
      o.globalBatch = 24;
      o.epochs = 2;
      o.balance = false;
      o.progress = hddp::ProgressMode::Off;
      o.loader.workers = 0;
      o.tensorboard = dir + (knowsItsRate ? "/knows" : "/does_not");
      auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(80, 1, 8, 4, 1);
      hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(),
                            *optimizer, ds, o);
      if (knowsItsRate) {
        trainer.setSchedule(schedule);
      }
      EXPECT_EQ(trainer.fit().totalSteps, 8);
    }
  });
  const auto rates = scalarsIn(dir + "/knows", "train/lr");
  ASSERT_EQ(rates.size(), 8u);
  for (const auto& [step, rate] : rates) {
    // StepInfo::step counts the steps done before it; TensorBoard's step includes it.
    EXPECT_EQ(rate, static_cast<float>(0.5 / static_cast<double>(step))) << "step " << step;
  }
  EXPECT_TRUE(scalarsIn(dir + "/does_not", "train/lr").empty());
  EXPECT_EQ(scalarsIn(dir + "/does_not", "train/loss").size(), 8u);
  removeTree(dir);
}

// A step in which rank 0 had no samples has no loss of rank 0's share: no train/loss
// point (it was written as 0, a loss the run never had); the other tags are written.
TEST(TrainerTensorBoard, AStepWithoutSamplesOnRank0WritesNoLoss) {
  const std::string dir = hddp::testing::makeTempDir();
  {
    hddp::train::Reporter reporter("", 0, false, false, false, 1);
    reporter.startTensorBoard(dir, 1);
    for (int64_t step = 1; step <= 3; ++step) {
      hddp::train::StepReport r;
      r.step = step;
      r.globalBatch = 16;
      r.localBatch = step == 2 ? 0 : 8;
      r.plan = {r.localBatch, 16 - r.localBatch};
      r.loss = step == 2 ? 0.0 : 1.5;
      r.stepSeconds = 0.1;
      reporter.step(r);
    }
  }
  const auto loss = scalarsIn(dir, "train/loss");
  ASSERT_EQ(loss.size(), 2u);
  EXPECT_EQ(loss[0].first, 1);
  EXPECT_EQ(loss[1].first, 3);
  EXPECT_EQ(scalarsIn(dir, "share/rank0").size(), 3u);
  removeTree(dir);
}

#else

// Without protobuf every rank refuses a TensorBoard folder when the Trainer is made, so
// no rank gets to fit() and waits there for the others.
TEST(TrainerTensorBoard, RefusedOnEveryRankWithoutProtobuf) {
  EXPECT_FALSE(hddp::tensorBoardAvailable());
  const std::string dir = hddp::testing::makeTempDir();
  std::vector<std::string> errors(2, "(no ConfigError)");
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    try {
      trainLinear(rank, size, store, [&](hddp::TrainerOptions& o) { o.tensorboard = dir; });
    } catch (const hddp::ConfigError& e) {
      errors[rank] = e.what_without_backtrace();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("built without protobuf"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find(dir), std::string::npos) << errors[r];
  }
}

#endif

}  // namespace
