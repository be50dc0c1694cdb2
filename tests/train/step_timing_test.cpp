// The planner under NCCL's semantics, on CPU ranks: Work::wait() returns at once and the
// host waits for a slower rank at the synchronization after backward
// (support/stream_semantics.h). The Trainer's step timer leaves that wait out of the
// compute time; a timer that takes host time to the status read does not, every rank
// then measures the slow rank's step time, and the split stays where it started.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "hddp/balance/cost_model.h"
#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "hddp/core/step_timer.h"
#include "hddp/data/datasets.h"
#include "hddp/ddp/sync_batch_norm.h"
#include "hddp/train/trainer.h"
#include "support/ranks.h"
#include "support/stream_semantics.h"

namespace {

using hddp::testing::runThreads;

// A model whose compute grows with the batch and not with the CPU's load: its forward
// takes 0.5 ms per sample (a sleep, so two ranks on two shared cores do not disturb
// each other's timing) besides a small MLP.
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(64, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    std::this_thread::sleep_for(std::chrono::microseconds(500 * x.size(0)));
    return fc2->forward(torch::relu(fc1->forward(x.flatten(1))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

// Host time from the step's start to the status read, less only DDP's own wait(): what
// a host-clock timer measures on NCCL, where that wait() returns at once.
class HostTimeToStatusRead final : public hddp::StepTimer {
 public:
  HostTimeToStatusRead() : host_(hddp::makeHostStepTimer()) {}
  void start(const hddp::StepLabel& label) override {
    spans_ = 0;
    depth_ = 0;
    host_->start(label);
  }
  // The first outermost span only (DDP's, with its buckets' waits nested in it).
  void beginWait() override {
    if (depth_++ == 0 && spans_ == 0) {
      host_->beginWait();
    }
  }
  void endWait() override {
    if (depth_ > 0 && --depth_ == 0 && spans_++ == 0) {
      host_->endWait();
    }
  }
  void stop() override { host_->stop(); }
  std::vector<hddp::StepTiming> collect() override { return host_->collect(); }
  const char* describe() const override { return "host time to the status read"; }

 private:
  std::unique_ptr<hddp::StepTimer> host_;
  int spans_ = 0;
  int depth_ = 0;
};

struct Run {
  std::vector<int64_t> plan;
  int deferred = 0;
  std::vector<at::Tensor> params;
};

// Two ranks behind the NCCL-semantics double, rank 1 computing 3x slower.
std::vector<Run> trainUnderStreamSemantics(bool hostTimeToStatusRead) {
  std::vector<Run> runs(2);
  std::mutex mutex;
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    hddp::testing::StreamSemanticsCommunicator comm(hddp::makeCommunicator(store, rank, size));
    torch::manual_seed(7);
    at::set_num_threads(1);
    Mlp model;
    torch::optim::SGD opt(model->parameters(), 0.01);
    hddp::TrainerOptions o;
    o.globalBatch = 64;
    o.maxSteps = 24;
    o.progress = hddp::ProgressMode::Off;
    o.loader.workers = 1;
    o.planner.calibrationSteps = 4;
    o.planner.rebalanceEvery = 4;
    o.seedPlan = false;  // the timer's measurements, not the seed, must find the split
    hddp::EmulationOptions slow;
    slow.slowdown = rank == 1 ? 3.0 : 1.0;
    o.emulation = slow;
    if (hostTimeToStatusRead) {
      o.stepTimer = [](const c10::Device&) { return std::make_unique<HostTimeToStatusRead>(); };
    }
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(64 * 24, 64, 1, 4);
    hddp::Trainer trainer(comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt, ds,
                          o);
    trainer.fit();
    std::lock_guard<std::mutex> lock(mutex);
    runs[rank].plan = trainer.planner()->plan().local;
    runs[rank].deferred = comm.deferredCompletions();
    for (const auto& p : model->parameters()) {
      runs[rank].params.push_back(p.detach().clone());
    }
  });
  return runs;
}

std::string describe(const std::vector<int64_t>& plan) {
  std::string s = "[";
  for (size_t i = 0; i < plan.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(plan[i]);
  }
  return s + "]";
}

TEST(StepTiming, PlannerReachesTheSplitUnderNcclSemantics) {
  const auto runs = trainUnderStreamSemantics(/*hostTimeToStatusRead=*/false);
  EXPECT_EQ(runs[0].plan, runs[1].plan);
  // The double did defer: the fast rank's wait() returned before the slow rank had sent.
  EXPECT_GT(runs[0].deferred, 0);
  // Results are read only after the synchronization: both ranks hold the same model.
  ASSERT_EQ(runs[0].params.size(), runs[1].params.size());
  for (size_t i = 0; i < runs[0].params.size(); ++i) {
    EXPECT_TRUE(runs[0].params[i].equal(runs[1].params[i])) << "parameter " << i;
  }
  // 3x slower: about 48 and 16 of 64 (the per-step overhead, 3x on rank 1 too, moves it
  // a sample or two); allow the timing noise of two threads on a shared CPU.
  const auto& plan = runs[0].plan;
  EXPECT_GE(plan[0], 42) << describe(plan);
  EXPECT_LE(plan[0], 52) << describe(plan);
}

// The failure the timer exists to avoid, shown with the double: host time to the status
// read includes the wait for the slow rank, both ranks measure about the same step time,
// and the split stays near equal.
TEST(StepTiming, HostTimeToTheStatusReadLeavesTheSplitNearEqual) {
  const auto runs = trainUnderStreamSemantics(/*hostTimeToStatusRead=*/true);
  EXPECT_EQ(runs[0].plan, runs[1].plan);
  EXPECT_LT(runs[0].plan[0], 42) << describe(runs[0].plan);
}

// A job whose gradients (a 64 -> 4096 linear layer: 1.05 MB) cross an emulated 20 MB/s
// link on both ranks, while compute and input are tiny: the allreduce cannot hide behind
// backward, so each step's comm_wait_s is the ring's time for the gradients (DDP's
// buckets share the link): 2(n-1)/n x S / B = 53 ms. Measured within 15%, on both ranks;
// the Trainer's allreduce_predicted_s (from the seed's links) says the same.
TEST(StepTiming, CommWaitOverAnEmulatedLinkIsTheRingTime) {
  const double link = 20e6;
  const std::string dir = hddp::testing::makeTempDir();
  double gradientBytes = 0;
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    torch::manual_seed(7);
    at::set_num_threads(1);
    torch::nn::Linear model(64, 4096);
    torch::optim::SGD opt(model->parameters(), 0.01);
    if (rank == 0) {
      for (const auto& p : model->parameters()) {
        gradientBytes += static_cast<double>(p.numel() * p.element_size());
      }
    }
    hddp::TrainerOptions o;
    o.globalBatch = 8;
    o.maxSteps = 12;
    o.progress = hddp::ProgressMode::Off;
    o.loader.workers = 1;
    o.metricsPath = dir + "/m.jsonl";
    hddp::EmulationOptions e;
    e.linkBytesPerSecond = link;        // the input copies (and the seed's link)
    e.collectiveBytesPerSecond = link;  // the collectives (the slowest of the job)
    o.emulation = e;
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(8 * 12, 1, 8, 4096);
    hddp::Trainer trainer(
        *comm, model.ptr(),
        [model](const at::Tensor& x) mutable { return model->forward(x.flatten(1)); },
        hddp::crossEntropy(), opt, ds, o);
    trainer.fit();
  });
  ASSERT_GT(gradientBytes, 1e6);
  const double ring = 2.0 * (2 - 1) / 2 * (gradientBytes + 4) / link;  // + DDP's status
  std::map<int, std::vector<double>> waits;
  std::vector<double> predicted;
  for (const char* file : {"/m.jsonl", "/m.rank1.jsonl"}) {
    std::ifstream in(dir + file);
    for (std::string line; std::getline(in, line);) {
      if (line.find("\"kind\":\"step\"") == std::string::npos) {
        continue;
      }
      const auto j = nlohmann::json::parse(line);
      if (j.value("step", 0) < 2) {
        continue;  // the first steps build and rebuild the buckets
      }
      waits[j.at("rank").get<int>()].push_back(j.at("comm_wait_s").get<double>());
      predicted.push_back(j.value("allreduce_predicted_s", 0.0));
    }
  }
  ASSERT_EQ(waits.size(), 2u);
  for (auto& w : waits) {
    ASSERT_GE(w.second.size(), 8u);
    std::sort(w.second.begin(), w.second.end());
    const double median = w.second[w.second.size() / 2];
    std::printf("rank %d: median comm_wait_s %.1f ms, the ring %.1f ms\n", w.first, median * 1e3,
                ring * 1e3);
    EXPECT_NEAR(median, ring, 0.15 * ring) << "rank " << w.first;
  }
  ASSERT_FALSE(predicted.empty());
  EXPECT_NEAR(predicted.front(), gradientBytes / link, 0.01 * ring);
}

// Tells a step timer of a communicator's waits, as the Trainer does.
struct TimerWaits final : hddp::WaitObserver {
  explicit TimerWaits(hddp::StepTimer& t) : timer(t) {}
  void beginWait() override { timer.beginWait(); }
  void endWait() override { timer.endWait(); }
  hddp::StepTimer& timer;
};

// A communicator tells its wait observers of every Work's wait(): the time rank 0 blocks
// for a late rank 1 is waiting on the observing timer; once the handle is removed,
// nothing is marked.
TEST(StepTiming, CommunicatorMarksEveryWaitOnItsTimer) {
  std::vector<hddp::StepTiming> timings(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto timer = hddp::makeHostStepTimer();
    TimerWaits waits(*timer);
    hddp::RemovableHandle handle = comm->addWaitObserver(waits);
    for (bool given : {true, false}) {
      if (!given) {
        handle.remove();
      }
      timer->start({given ? 1 : 2, 1, 0});
      if (rank == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      at::Tensor t = torch::ones({4});
      comm->allreduce(t).wait();
      timer->stop();
      const auto done = timer->collect();
      ASSERT_EQ(done.size(), 1u);
      if (rank == 0) {
        timings[given ? 0 : 1] = done[0];
      }
    }
  });
  EXPECT_GE(timings[0].waitSeconds, 0.08);
  EXPECT_LT(timings[0].computeSeconds(), 0.05);
  EXPECT_EQ(timings[1].waitSeconds, 0.0);
  EXPECT_GE(timings[1].computeSeconds(), 0.08);
}

// The MLP with SyncBatchNorm between its layers, 0.5 ms of forward per sample (a sleep).
struct BnMlpImpl : torch::nn::Module {
  BnMlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(64, 32));
    bn = register_module("bn", hddp::SyncBatchNorm(32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    std::this_thread::sleep_for(std::chrono::microseconds(500 * x.size(0)));
    return fc2->forward(torch::relu(bn->forward(fc1->forward(x.flatten(1)))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  hddp::SyncBatchNorm bn{nullptr};
};
TORCH_MODULE(BnMlp);

// SyncBatchNorm's collectives run inside forward and backward: the fast rank blocks in
// them until the slow rank arrives. Those waits are waiting, not compute (every Work
// of the Trainer's communicator marks its wait on the step timer), so the calibration
// finds the compute-only split: rank 1 emulated 30x slower, [15, 1] of 16 (SyncBatchNorm
// keeps one sample on every rank). Counted as compute, the waits made both ranks
// measure about the same step and the split stayed near [9, 7].
TEST(StepTiming, PlannerSeesThroughSyncBatchNormWaits) {
  std::vector<std::vector<int64_t>> last(2);
  std::mutex mutex;
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    torch::manual_seed(3);
    at::set_num_threads(1);
    BnMlp model;
    hddp::convertSyncBatchNorm(*model, *comm);  // attaches the communicator
    torch::optim::SGD opt(model->parameters(), 0.01);
    hddp::TrainerOptions o;
    o.globalBatch = 16;
    o.maxSteps = 9;
    o.progress = hddp::ProgressMode::Off;
    o.seedPlan = false;  // the calibration, from measured steps, must find the split
    o.planner.calibrationSteps = 3;
    o.planner.rebalanceEvery = 3;
    hddp::EmulationOptions slow;
    slow.slowdown = rank == 1 ? 30.0 : 1.0;
    o.emulation = slow;
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(16 * 9, 64, 1, 4);
    hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt, ds,
                          o);
    trainer.fit();
    std::lock_guard<std::mutex> lock(mutex);
    last[rank] = trainer.planner()->plan().local;
  });
  EXPECT_EQ(last[0], last[1]);
  EXPECT_EQ(last[0], (std::vector<int64_t>{15, 1})) << describe(last[0]);
}

TEST(StepTiming, CostOfAProfileUsesTheBestKnownLink) {
  hddp::RankProfile cpu;
  cpu.bytesPerSample = 1000;
  cpu.computeSecondsPerSample = 0.001;
  EXPECT_EQ(hddp::costOf(cpu).linkBytesPerSecond, 0.0);  // the input is in its memory
  EXPECT_EQ(hddp::linkSource(cpu), "none");
  hddp::RankProfile egpu = cpu;
  egpu.device = c10::Device(c10::kCUDA, 0);
  egpu.link = hddp::PcieLink{3, 4, 3, 16, "0000:05:00.0"};
  egpu.transferOverlapped = true;
  EXPECT_NEAR(hddp::costOf(egpu).linkBytesPerSecond, hddp::pcieGBps(3, 4) * 1e9, 1.0);
  EXPECT_EQ(hddp::linkSource(egpu), "PCIe Gen3 x4 (nominal)");
  EXPECT_TRUE(hddp::costOf(egpu).transferOverlapped);
  egpu.measuredBytesPerSecond = 2.8e9;
  EXPECT_EQ(hddp::costOf(egpu).linkBytesPerSecond, 2.8e9);
  EXPECT_EQ(hddp::linkSource(egpu), "measured");
  egpu.emulatedLinkBytesPerSecond = 1e9;
  egpu.emulatedSlowdown = 2.0;
  const auto c = hddp::costOf(egpu);
  EXPECT_EQ(c.linkBytesPerSecond, 1e9);
  EXPECT_FALSE(c.transferOverlapped);  // an emulated link is slept after the step
  EXPECT_DOUBLE_EQ(c.secondsPerSample, 0.002);
  // Overlapped copies: the step pays the larger of compute and transfer per sample.
  hddp::RankCost overlapped;
  overlapped.secondsPerSample = 0.001;
  overlapped.bytesPerSample = 3000;
  overlapped.linkBytesPerSecond = 1e6;  // 3 ms per sample
  overlapped.transferOverlapped = true;
  EXPECT_DOUBLE_EQ(overlapped.perSampleSeconds(), 0.003);
  overlapped.transferOverlapped = false;
  EXPECT_DOUBLE_EQ(overlapped.perSampleSeconds(), 0.004);
}

#define SKIP_WITHOUT_CUDA()                                                                \
  if (!torch::cuda::is_available() || !hddp::ncclAvailable()) {                            \
    GTEST_SKIP() << "needs a CUDA device and the NCCL build (run tools/gpu-check.sh on a " \
                    "GPU machine)";                                                        \
  }

// The Trainer on one GPU with NCCL times its steps with device events and hands the
// planner compute times (one step late), with no synchronization added for timing, and
// the input copies timed by events on the loader's copy stream.
TEST(StepTiming, TrainerTimesStepsWithDeviceEvents_CUDA) {
  SKIP_WITHOUT_CUDA();
  const std::string dir = hddp::testing::makeTempDir();
  auto store = hddp::Store::memory();
  hddp::CommunicatorOptions co;
  co.backend = hddp::Backend::Nccl;
  co.device = c10::Device(c10::kCUDA, 0);
  auto comm = hddp::makeCommunicator(store, 0, 1, co);
  Mlp model;
  model->to(co.device);
  torch::optim::SGD opt(model->parameters(), 0.01);
  hddp::TrainerOptions o;
  o.globalBatch = 64;
  o.maxSteps = 12;
  o.progress = hddp::ProgressMode::Off;
  o.logEvery = 1;
  o.metricsPath = dir + "/m.jsonl";
  auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(64 * 12, 64, 1, 4);
  hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt, ds,
                        o);
  trainer.fit();
  std::ifstream in(dir + "/m.jsonl");
  int withCompute = 0;
  int withTransfer = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.find("\"kind\":\"step\"") == std::string::npos) {
      continue;
    }
    const auto at = line.find("\"compute_s\":");
    ASSERT_NE(at, std::string::npos) << line;
    withCompute += std::stod(line.substr(at + 12)) > 0 ? 1 : 0;
    // The input copy, timed by the loader's events on its copy stream.
    const auto copy = line.find("\"transfer_s\":");
    withTransfer += copy != std::string::npos && std::stod(line.substr(copy + 13)) > 0 ? 1 : 0;
  }
  EXPECT_GE(withCompute, 10);   // every step but the first (read one step late)
  EXPECT_GE(withTransfer, 10);  // likewise
}

}  // namespace
