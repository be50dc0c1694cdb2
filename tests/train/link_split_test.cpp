// The split follows a rank's input link: an emulated link reaches the seed and the
// planner, and on a device the copy times of the loader's events reach the planner.
// Every time the planner learns from runs on each rank's virtual clock
// (support/virtual_time.h), so the plans are the solver's split of the costs the tests
// set, exactly, however slow or loaded the machine (DESIGN.md: no test needs a speed).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "hddp/balance/batch_plan.h"
#include "hddp/balance/cost_model.h"
#include "hddp/comm/communicator.h"
#include "hddp/data/datasets.h"
#include "hddp/train/trainer.h"
#include "support/ranks.h"
#include "support/virtual_time.h"

namespace {

using hddp::testing::runThreads;
using hddp::testing::VirtualClock;

constexpr double kLinkBytesPerSecond = 50e6;
constexpr double kSampleBytes = 3 * 64 * 64 * 4;  // a 3x64x64 float image
constexpr double kSecondsPerSample = 3e-4;        // compute, on both ranks

std::string describe(const std::vector<int64_t>& plan) {
  std::string s = "[";
  for (size_t i = 0; i < plan.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(plan[i]);
  }
  return s + "]";
}

// The solver's split of 32 samples when both ranks compute kSecondsPerSample and rank 1's
// `bytesPerSample` cross a link of kLinkBytesPerSecond.
std::vector<int64_t> splitOverTheLink(double bytesPerSample) {
  std::vector<hddp::RankCost> costs(2);
  costs[0].secondsPerSample = costs[1].secondsPerSample = kSecondsPerSample;
  costs[1].bytesPerSample = bytesPerSample;
  costs[1].linkBytesPerSecond = kLinkBytesPerSecond;
  return hddp::solveSplit(costs, 32).local;
}

// One rank of the link tests' job: a linear layer of 0.3 ms compute per sample on the
// rank's virtual clock, a third in forward and two thirds in backward (as the seed's timed
// forward assumes); 32 samples a step for 16 steps, a plan every 4, metrics in `dir`. Its
// emulation is `emulation`, its step timer reports the copy times of a link of
// `copyBytesPerSecond` (0: none).
struct LinkJob {
  std::vector<int64_t> seeded;  // the plan before the first step
  std::vector<hddp::RankCost> seedCosts;
  std::vector<int64_t> last;
  std::vector<hddp::RankCost> costs;
};

LinkJob runLinkJob(int rank, int size, hddp::Store& store, const std::string& dir,
                   const hddp::EmulationOptions& emulation, double copyBytesPerSecond) {
  auto comm = hddp::makeCommunicator(store, rank, size);
  torch::manual_seed(7);
  at::set_num_threads(1);
  torch::nn::Linear model(3 * 64 * 64, 4);
  torch::optim::SGD opt(model->parameters(), 0.01);
  hddp::TrainerOptions o;
  o.globalBatch = 32;
  o.maxSteps = 16;
  o.progress = hddp::ProgressMode::Off;
  o.loader.workers = 1;
  o.planner.calibrationSteps = 4;
  o.planner.rebalanceEvery = 4;
  o.metricsPath = dir + "/m.jsonl";
  o.emulation = emulation;
  auto clock = std::make_shared<VirtualClock>();
  hddp::testing::measureOn(clock, o, copyBytesPerSecond);
  auto forward = [model, clock](const at::Tensor& x) mutable {
    const auto b = static_cast<double>(x.size(0));
    clock->advance(kSecondsPerSample / 3 * b);
    return hddp::testing::costsInBackward(model->forward(x.flatten(1)), clock,
                                          kSecondsPerSample * 2 / 3 * b);
  };
  auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(32 * 16, 3, 64, 4);
  hddp::Trainer trainer(*comm, model.ptr(), forward, hddp::crossEntropy(), opt, ds, o);
  LinkJob job;
  job.seeded = trainer.plan().local;
  job.seedCosts = trainer.planner()->costs();
  trainer.fit();
  job.last = trainer.planner()->plan().local;
  job.costs = trainer.planner()->costs();
  return job;
}

// Both ranks' jobs; rank 1 with `emulation` and copies timed over `copyBytesPerSecond`.
std::vector<LinkJob> runLinkJobs(const std::string& dir, const hddp::EmulationOptions& emulation,
                                 double copyBytesPerSecond) {
  std::vector<LinkJob> jobs(2);
  std::mutex mutex;
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    LinkJob job =
        runLinkJob(rank, size, store, dir, rank == 1 ? emulation : hddp::EmulationOptions{},
                   rank == 1 ? copyBytesPerSecond : 0.0);
    std::lock_guard<std::mutex> lock(mutex);
    jobs[rank] = std::move(job);
  });
  return jobs;
}

// Equal compute, rank 1's input link emulated at 50 MB/s: its 48 KiB samples take
// ~1 ms each over the link besides 0.3 ms of compute, so the split follows the link
// ([26, 6] of 32) and not the compute alone ([16, 16]). The seed already gives that
// split to the first step, and the measured transfer keeps it.
TEST(StepTiming, TheSplitFollowsTheLinkFromTheFirstStep) {
  const std::string dir = hddp::testing::makeTempDir();
  hddp::EmulationOptions link;
  link.linkBytesPerSecond = kLinkBytesPerSecond;
  const std::vector<LinkJob> jobs = runLinkJobs(dir, link, 0.0);
  const auto predicted = splitOverTheLink(kSampleBytes);
  ASSERT_EQ(predicted, (std::vector<int64_t>{26, 6}));
  EXPECT_EQ(jobs[0].seeded, predicted) << describe(jobs[0].seeded);
  EXPECT_EQ(jobs[1].seeded, predicted) << describe(jobs[1].seeded);
  // The seed: the timed forward's 0.3 ms/sample on both, the emulated link on rank 1's.
  const auto& seed = jobs[0].seedCosts;
  ASSERT_EQ(seed.size(), 2u);
  EXPECT_NEAR(seed[0].secondsPerSample, kSecondsPerSample, 1e-12);
  EXPECT_NEAR(seed[1].secondsPerSample, kSecondsPerSample, 1e-12);
  EXPECT_EQ(seed[0].linkBytesPerSecond, 0.0);
  EXPECT_EQ(seed[1].linkBytesPerSecond, kLinkBytesPerSecond);
  EXPECT_EQ(seed[1].bytesPerSample, kSampleBytes);
  // The steps' transfer kept the link in rank 1's cost: its bytes are the measured ones,
  // with the int64 label (49160 a sample); the seed's were the image's alone (49152), and
  // a planner that dropped the measured transfer would still hold those.
  const auto measured = splitOverTheLink(kSampleBytes + 8);
  EXPECT_EQ(jobs[0].last, measured) << describe(jobs[0].last);
  EXPECT_EQ(jobs[1].last, measured) << describe(jobs[1].last);
  const auto& costs = jobs[0].costs;
  EXPECT_NEAR(costs[1].linkBytesPerSecond, kLinkBytesPerSecond, 1e-6 * kLinkBytesPerSecond);
  EXPECT_NEAR(costs[1].bytesPerSample, kSampleBytes + 8, 1e-6);
  EXPECT_NEAR(costs[1].secondsPerSample, kSecondsPerSample, 1e-12);
  EXPECT_EQ(costs[0].linkBytesPerSecond, 0.0);
  // The gradients' allreduce over the slowest link (rank 1's), in every step record:
  // a ring of 2 sends the 4 x 12288 + 4 float gradients once each way.
  const double gradientBytes = (4.0 * kSampleBytes / 4 + 4) * 4;
  std::ifstream in(dir + "/m.jsonl");
  int steps = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.find("\"kind\":\"step\"") == std::string::npos) {
      continue;
    }
    const auto at = line.find("\"allreduce_predicted_s\":");
    ASSERT_NE(at, std::string::npos) << line;
    EXPECT_NEAR(std::stod(line.substr(at + 24)), gradientBytes / kLinkBytesPerSecond, 1e-9);
    ++steps;
  }
  EXPECT_EQ(steps, 16);
}

// No emulation and no link in the seed (CPU ranks): only the step timer's copy times (what
// the device timer hands over on a GPU, from events around the loader's copy) tell the
// Trainer that rank 1's input is slow to arrive. The planner takes the transfer into
// rank 1's cost and moves the split from the seed's [16, 16] to the link's [26, 6]; each
// of rank 1's step records carries the transfer.
TEST(StepTiming, MeasuredCopyTimesReachThePlanner) {
  const std::string dir = hddp::testing::makeTempDir();
  const std::vector<LinkJob> jobs = runLinkJobs(dir, hddp::EmulationOptions{}, kLinkBytesPerSecond);
  for (const LinkJob& job : jobs) {
    EXPECT_EQ(job.seeded, (std::vector<int64_t>{16, 16})) << "the seed knows no link";
    ASSERT_EQ(job.seedCosts.size(), 2u);
    EXPECT_EQ(job.seedCosts[1].linkBytesPerSecond, 0.0);
  }
  const auto predicted = splitOverTheLink(kSampleBytes + 8);  // + the int64 label
  ASSERT_EQ(predicted, (std::vector<int64_t>{26, 6}));
  EXPECT_EQ(jobs[0].last, predicted) << describe(jobs[0].last);
  EXPECT_EQ(jobs[1].last, predicted) << describe(jobs[1].last);
  const auto& costs = jobs[0].costs;
  EXPECT_NEAR(costs[1].linkBytesPerSecond, kLinkBytesPerSecond, 1e-6 * kLinkBytesPerSecond);
  EXPECT_EQ(costs[0].linkBytesPerSecond, 0.0);
  std::ifstream in(dir + "/m.rank1.jsonl");
  int withTransfer = 0;
  for (std::string line; std::getline(in, line);) {
    withTransfer += line.find("\"kind\":\"step\"") != std::string::npos &&
                    line.find("\"transfer_s\":") != std::string::npos;
  }
  EXPECT_EQ(withTransfer, 16);
}

}  // namespace
