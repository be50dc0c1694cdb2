// The planner's split in TensorBoard when the planner's evidence is injected: a step
// timer that reports a fixed cost per sample, as an emulated card of a known speed
// would, so that the plan changes at a known step on any machine, loaded or not.
// (tests/train/tensorboard_python_test.py reads a real run with TensorBoard's own
// reader; whether and when its planner changes the split depends on measured times, so
// it checks only that the texts match the changes the metrics report.)
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
#include "hddp/train/trainer.h"
#include "support/event_records.h"
#include "support/fixed_rate_timer.h"
#include "support/ranks.h"

namespace {

#if HDDP_TEST_TENSORBOARD

using hddp::testing::event_records::scalarValuesIn;
using hddp::testing::event_records::textsIn;

using hddp::testing::FixedRateTimer;

// Rank 1 measures 3x rank 0's seconds per sample. The planner (its defaults: first
// update after 3 calibration steps, then every 10) starts from the equal split (no
// seed) and adopts the measured split outright at its first update, [15, 5] of 20
// (equal step times), from step 4; it holds for the run's other 4 steps. TensorBoard
// gets the split as text at step 1 and at step 3 (the change), and each rank's share at
// every step.
TEST(TrainerTensorBoard, APlanChangeFromInjectedTimingsIsTextAtTheStepOfTheChange) {
  const std::string dir = hddp::testing::makeTempDir();
  std::vector<std::vector<int64_t>> plans(2);
  std::mutex mutex;
  hddp::testing::runThreads(2, [&](int rank, int size, hddp::Store& store) {
    hddp::CommunicatorOptions co;
    co.timeout = std::chrono::seconds(60);  // a rank left waiting fails, not hangs
    auto comm = hddp::makeCommunicator(store, rank, size, co);
    torch::manual_seed(7);
    torch::nn::Sequential model(torch::nn::Flatten(), torch::nn::Linear(64, 4));
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
    hddp::TrainerOptions o;
    o.globalBatch = 20;
    o.epochs = 2;  // 80 samples: 4 steps an epoch
    o.balance = true;
    o.seedPlan = false;
    o.progress = hddp::ProgressMode::Off;
    o.loader.workers = 0;
    o.tensorboard = dir;
    const double secondsPerSample = (rank == 1 ? 3.0 : 1.0) / 1024;
    o.stepTimer = [secondsPerSample](const c10::Device&) {
      return std::make_unique<FixedRateTimer>(secondsPerSample);
    };
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(80, 1, 8, 4, /*seed=*/1);
    hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt, ds,
                          o);
    EXPECT_EQ(trainer.fit().totalSteps, 8);
    std::lock_guard<std::mutex> lock(mutex);
    plans[rank] = trainer.planner()->plan().local;
  });
  EXPECT_EQ(plans[0], (std::vector<int64_t>{15, 5}));
  EXPECT_EQ(plans[1], plans[0]);
  const std::vector<std::pair<int64_t, std::string>> want = {
      {1, "step 1: [10, 10] of 20"},
      {3, "from step 4: [15, 5] of 20 (was [10, 10] of 20)"},
  };
  EXPECT_EQ(textsIn(dir, "plan"), want);
  const auto shares = scalarValuesIn(dir, "share/rank1");
  ASSERT_EQ(shares.size(), 8u);
  for (const auto& [step, share] : shares) {
    EXPECT_EQ(share, step <= 3 ? 0.5f : 0.25f) << "step " << step;
  }
  ASSERT_EQ(std::system(("rm -rf '" + dir + "'").c_str()), 0) << dir;
}

#endif

}  // namespace
