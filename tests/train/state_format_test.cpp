// State files of an earlier format still load: a checked-in file of format version 3 (the
// format before state files were written part by part, issue #50) resumes and ends as a
// run trained straight through on this machine.
//
// The fixture, tests/train/fixtures/state-v3/state-00000006.hddp, was written by this
// test's writer (HDDP_WRITE_STATE_FIXTURE=<folder> build/tests/hddp_tests
// --gtest_filter=StateFormat.*): 2 ranks, a planner fed by fixed-rate timers (rank 1 3x
// slower: the split moves to [15, 5] at step 4), SGD with momentum, BatchNorm, a part of
// the program's with a state, stopped by maxSteps inside epoch 1 at step 6.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/step_timer.h"
#include "hddp/data/datasets.h"
#include "hddp/train/part.h"
#include "hddp/train/trainer.h"
#include "support/disk.h"
#include "support/fixed_rate_timer.h"
#include "support/ranks.h"
#include "support/trainer_runs.h"

namespace {

using hddp::testing::FixedRateTimer;

// A part of the program's with a state: the steps it has seen.
class StepsSeen final : public hddp::TrainerPart {
 public:
  std::string name() const override { return "steps_seen"; }
  void afterOptimizerStep(const hddp::StepEnd&, hddp::LoopRequests&) override { ++seen; }
  int stateVersion() const override { return 1; }
  std::string saveState() const override { return std::to_string(seen); }
  void loadState(const std::string& bytes, int) override { seen = std::stoll(bytes); }
  int64_t seen = 0;
};

struct Outcome {
  std::vector<at::Tensor> state;  // rank 0's parameters and buffers at the end
  int64_t startStep = -1;         // the step the run started from (after its resume)
  std::vector<int64_t> plan;
  int64_t partSeen = -1;
};

// 80 samples, global batch 20: 4 steps an epoch, 3 epochs.
Outcome run(const std::string& saveDir, const std::string& resume, int64_t maxSteps) {
  Outcome out;
  std::mutex mutex;
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions co;
    co.timeout = std::chrono::seconds(60);
    auto comm = hddp::makeCommunicator(store, rank, size, co);
    hddp::testing::Net model{nullptr};
    {
      // The ranks are threads sharing torch's global generator: one at a time, so that
      // rank 0's initial parameters (DDP broadcasts them) are the seed's on any run.
      std::lock_guard<std::mutex> lock(mutex);
      torch::manual_seed(11);
      model = hddp::testing::Net();
    }
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    hddp::TrainerOptions o;
    o.globalBatch = 20;
    o.epochs = 3;
    o.maxSteps = maxSteps;
    o.balance = true;
    o.seedPlan = false;
    o.progress = hddp::ProgressMode::Off;
    o.loader.workers = 0;
    o.saveDir = saveDir;
    o.resume = resume;
    const double secondsPerSample = (rank == 1 ? 3.0 : 1.0) / 1024;
    o.stepTimer = [secondsPerSample](const c10::Device&) {
      return std::make_unique<FixedRateTimer>(secondsPerSample);
    };
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(80, 1, 8, 4, /*seed=*/1);
    hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt, ds,
                          o);
    auto part = std::make_shared<StepsSeen>();
    trainer.addPart(part);
    const hddp::TrainSummary summary = trainer.fit();
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mutex);
      for (const auto& p : model->parameters()) {
        out.state.push_back(p.detach().clone());
      }
      for (const auto& b : model->buffers()) {
        out.state.push_back(b.detach().clone());
      }
      out.startStep = summary.totalSteps - summary.steps;
      out.plan = trainer.plan().local;
      out.partSeen = part->seen;
    }
  });
  return out;
}

TEST(StateFormat, AVersion3FileResumesAndEndsAsAStraightRun) {
  if (const char* dir = std::getenv("HDDP_WRITE_STATE_FIXTURE")) {
    run(dir, "", /*maxSteps=*/6);  // writes <dir>/state-00000006.hddp
    GTEST_SKIP() << "wrote the fixture to " << dir;
  }
  const std::string fixture =
      std::string(HDDP_TEST_SOURCE_DIR) + "/train/fixtures/state-v3/state-00000006.hddp";
  const Outcome straight = run("", "", 0);
  const std::string dir = hddp::testing::makeTempDir();
  const Outcome resumed = run(dir, fixture, 0);
  EXPECT_EQ(resumed.startStep, 6);
  EXPECT_EQ(resumed.plan, (std::vector<int64_t>{15, 5}));  // the planner's state came back
  EXPECT_EQ(resumed.partSeen, 12);                         // 6 from the file, 6 more
  EXPECT_EQ(straight.plan, resumed.plan);
  ASSERT_EQ(straight.state.size(), resumed.state.size());
  ASSERT_FALSE(straight.state.empty());
  // The fixture's first 6 steps ran on another machine: float32 rounding may differ in
  // the last bits there, nothing more (a lost momentum or sampler position is 1e-2 off).
  for (size_t i = 0; i < straight.state.size(); ++i) {
    EXPECT_TRUE(at::allclose(resumed.state[i].to(at::kDouble), straight.state[i].to(at::kDouble),
                             /*rtol=*/1e-4, /*atol=*/1e-6))
        << "tensor " << i << " differs by "
        << (resumed.state[i] - straight.state[i]).abs().max().item<double>();
  }
  hddp::testing::removeTree(dir);
}

}  // namespace
