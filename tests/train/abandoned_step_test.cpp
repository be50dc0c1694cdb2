// A step that is abandoned (a rank ran out of memory; the step is repeated under a new
// split) leaves no trace: after the repeat the model, BatchNorm's statistics, the
// optimizer and PowerSGD's memories are those of a straight run of the new split
// (issue #48, item 3; DESIGN.md "An abandoned or skipped step leaves no trace").
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/data/datasets.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "hddp/ddp/power_sgd.h"
#include "hddp/train/state_file.h"
#include "hddp/train/step_rollback.h"
#include "hddp/train/trainer.h"
#include "support/emulated_device.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runThreads;

struct BnNetImpl : torch::nn::Module {
  BnNetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 6, 3).padding(1)));
    bn = register_module("bn", torch::nn::BatchNorm2d(6));
    fc = register_module("fc", torch::nn::Linear(6 * 8 * 8, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc->forward(torch::relu(bn->forward(conv->forward(x))).flatten(1));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(BnNet);

std::mutex initMutex;  // the ranks are threads of one process: one seeded init at a time

// What a run ends with on rank `rank`: parameters, buffers (BatchNorm's statistics and
// count), the optimizer's momentum and PowerSGD's state.
using Final = std::map<std::string, at::Tensor>;

struct RunResult {
  Final state;
  int64_t repeatedSteps = 0;
  std::vector<int64_t> caps;  // the planner's memory caps at the end
  std::vector<int64_t> plan;  // its split at the end
};

RunResult trainRun(int rank, int size, hddp::Store& store,
                   const std::function<void(hddp::TrainerOptions&)>& configure) {
  auto comm = hddp::makeCommunicator(store, rank, size);
  BnNet model{nullptr};
  {
    std::lock_guard<std::mutex> lock(initMutex);
    torch::manual_seed(7);
    model = BnNet();
  }
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  hddp::TrainerOptions o;
  o.globalBatch = 64;
  o.epochs = 1;
  o.progress = hddp::ProgressMode::Off;
  o.seedPlan = false;  // the equal split, [32, 32], until a cap says otherwise
  // Only caps move the split: measured timings never do (they depend on the machine).
  o.planner.calibrationSteps = 0;
  o.planner.rebalanceEvery = 1000000;
  o.planner.probeEvery = 1000000;
  o.loader.workers = 0;
  o.ddp.compression = hddp::GradCompression::PowerSgd;
  o.ddp.powerSgd.rank = 1;
  o.ddp.powerSgd.startStep = 2;
  configure(o);
  auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(640, 1, 8, 4, /*seed=*/3);
  hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt, ds,
                        o);
  const auto summary = trainer.fit();
  RunResult out;
  out.repeatedSteps = summary.repeatedSteps;
  out.caps = trainer.planner()->memoryCaps();
  out.plan = trainer.plan().local;
  for (const auto& p : model->named_parameters()) {
    out.state["param." + p.key()] = p.value().detach().clone();
  }
  for (const auto& b : model->named_buffers()) {
    out.state["buffer." + b.key()] = b.value().detach().clone();
  }
  size_t i = 0;
  for (const auto& p : model->parameters()) {
    auto it = opt.state().find(p.unsafeGetTensorImpl());
    if (it != opt.state().end()) {
      auto& s = static_cast<torch::optim::SGDParamState&>(*it->second);
      out.state["momentum." + std::to_string(i)] = s.momentum_buffer().clone();
    }
    ++i;
  }
  if (const auto& powerSgd = trainer.ddp().powerSgdState()) {
    for (const auto& item : powerSgd->stateDict()) {
      out.state["powersgd." + item.first] = item.second;
    }
  }
  return out;
}

// The runs B and C: 4 steps of [32, 32] saved; then B resumes with rank 1
// "running out of memory" above 29 samples (emulated), so its step 5 is abandoned, rank
// 1's cap is learned and the step is repeated under the new split; C resumes the same
// file with that cap given, so it trains the same split straight. B must equal C bit for
// bit: before the fix PowerSGD's memories and BatchNorm's statistics (num_batches_tracked
// one higher) kept the abandoned step.
void expectAbandonedEqualsStraight(const std::function<void(hddp::TrainerOptions&)>& common) {
  const std::string dir = hddp::testing::makeTempDir();
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      common(o);
      o.saveDir = dir + "/first";
      o.maxSteps = 4;
    });
  });
  const std::string saved = hddp::stateFileName(dir + "/first", 4);
  std::vector<RunResult> abandoned(2);
  std::vector<RunResult> straight(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    abandoned[static_cast<size_t>(rank)] =
        trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
          common(o);
          o.resume = saved;
          o.maxSteps = 8;
          hddp::EmulationOptions e;
          e.memoryCapSamples = rank == 1 ? 29 : 0;
          o.emulation = e;
        });
  });
  ASSERT_EQ(abandoned[0].caps.size(), 2u);
  const int64_t learned = abandoned[0].caps[1];
  ASSERT_LE(learned, 29) << "rank 1's cap was not learned";
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    straight[static_cast<size_t>(rank)] = trainRun(rank, size, store, [&](hddp::TrainerOptions& o) {
      common(o);
      o.resume = saved;
      o.maxSteps = 8;
      o.maxLocalBatch = {0, learned};
    });
  });
  EXPECT_EQ(abandoned[0].plan, straight[0].plan) << "the runs did not train the same split";
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_GE(abandoned[r].repeatedSteps, 1) << "rank " << r << ": no step was abandoned";
    EXPECT_EQ(straight[r].repeatedSteps, 0) << "rank " << r;
    const Final& a = abandoned[r].state;
    const Final& b = straight[r].state;
    ASSERT_EQ(a.size(), b.size()) << "rank " << r;
    EXPECT_TRUE(std::any_of(a.begin(), a.end(), [](const auto& item) {
      return item.first.rfind("powersgd.q/", 0) == 0;
    })) << "PowerSGD never compressed";
    for (const auto& item : b) {
      const auto other = a.find(item.first);
      ASSERT_NE(other, a.end()) << "rank " << r << ": " << item.first;
      EXPECT_TRUE(at::equal(other->second, item.second))
          << "rank " << r << ": " << item.first << " differs after the abandoned step; largest "
          << "difference "
          << (other->second.to(at::kDouble) - item.second.to(at::kDouble))
                 .abs()
                 .max()
                 .item<double>();
    }
  }
}

TEST(Trainer, AnAbandonedStepLeavesNoTraceInPowerSgdBatchNormOrRng) {
  expectAbandonedEqualsStraight([](hddp::TrainerOptions&) {});
}

// DDP's step count paces the buffers' synchronisation (BatchNorm's statistics set to
// their sample-weighted mean over ranks every bufferSyncInterval steps): an abandoned step must not
// count, or the repeat syncs one step early and rank 1's statistics end those of another schedule.
// Before the fix rank 1's running mean differed from the straight run's.
TEST(Trainer, AnAbandonedStepDoesNotShiftTheBufferSyncInterval) {
  expectAbandonedEqualsStraight([](hddp::TrainerOptions& o) { o.ddp.bufferSyncInterval = 2; });
}

// A step the GradScaler skips (a float16 overflow on some rank: every rank skips) leaves
// no trace in BatchNorm's statistics either: with a first scale of 2^40 the first step's
// gradients overflow, so a one-step run ends with the model it started from, buffers
// (running statistics and num_batches_tracked) included. Before the fix the skipped
// forward's statistics stayed (num_batches_tracked 1). fp16 needs a device: emu.
TEST(Trainer, ASkippedStepLeavesNoTraceInBatchNorm_Emu) {
  hddp::testing::emulatedDevice(0);  // installs emu
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);  // Gloo, staging emu tensors
    const c10::Device device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(rank));
    BnNet model{nullptr};
    {
      std::lock_guard<std::mutex> lock(initMutex);
      torch::manual_seed(7);
      model = BnNet();
    }
    model->to(device);
    std::map<std::string, at::Tensor> before;
    for (const auto& item : model->named_parameters()) {
      before[item.key()] = item.value().detach().cpu().clone();
    }
    for (const auto& item : model->named_buffers()) {
      before[item.key()] = item.value().detach().cpu().clone();
    }
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    hddp::TrainerOptions o;
    o.globalBatch = 16;
    o.maxSteps = 1;
    o.balance = false;
    o.progress = hddp::ProgressMode::Off;
    o.loader.workers = 0;
    o.amp = hddp::AmpMode::Fp16;
    o.scaler.initScale = std::ldexp(1.0, 40);
    o.scaler.backoffFactor = std::ldexp(1.0, -32);
    auto ds = std::make_shared<hddp::SyntheticClassificationDataset>(64, 1, 8, 4, /*seed=*/3);
    hddp::Trainer trainer(*comm, model.ptr(), hddp::forwardOf(model), hddp::crossEntropy(), opt, ds,
                          o);
    trainer.fit();
    EXPECT_EQ(trainer.scaler().currentScale(), 256.0) << "rank " << rank << ": no step was skipped";
    EXPECT_EQ(model->bn->num_batches_tracked.item<int64_t>(), 0) << "rank " << rank;
    for (const auto& item : model->named_parameters()) {
      EXPECT_TRUE(at::equal(item.value().detach().cpu(), before[item.key()]))
          << "rank " << rank << ": " << item.key();
    }
    for (const auto& item : model->named_buffers()) {
      EXPECT_TRUE(at::equal(item.value().detach().cpu(), before[item.key()]))
          << "rank " << rank << ": " << item.key() << " kept the skipped step's statistics";
    }
  });
  hddp::emu::checkNoViolations();
}

// A skipped step's statistics are put back, and so is their weight in the next buffer
// synchronisation (every second step here): the buffers after step 4 are the weighted
// mean over ranks of each rank's statistics of steps 1, 3 and 4, weighed by its shares
// of those steps only. Before the fix the skipped step's share stayed in the weight (or,
// when the skipped step synced, the earlier steps' shares were lost).
TEST(StepRollback, ASkippedStepsBuffersLeaveTheNextSyncsWeightsToo) {
  constexpr int64_t kGlobal = 16;
  const std::vector<std::vector<int64_t>> shares{{4, 12}, {10, 6}, {3, 13}, {9, 7}};
  // [rank]: BatchNorm's running mean after step 4; with `skip` the run skips step 2 and
  // syncs every second step, without it the run leaves step 2 out and never syncs.
  auto run = [&](bool skip) {
    std::vector<at::Tensor> means(2);
    std::vector<double> weights(2, 0.0);
    runThreads(2, [&](int rank, int size, hddp::Store& store) {
      auto comm = hddp::makeCommunicator(store, rank, size);
      BnNet model{nullptr};
      {
        std::lock_guard<std::mutex> lock(initMutex);
        torch::manual_seed(7);
        model = BnNet();
      }
      hddp::DdpOptions options;
      options.bufferSync = skip ? hddp::BufferSync::WithGradients : hddp::BufferSync::None;
      options.bufferSyncInterval = 2;
      hddp::DistributedDataParallel ddp(model.ptr(), *comm, options);
      hddp::StepRollback rollback(*model, c10::Device(c10::kCPU));
      for (size_t step = 0; step < shares.size(); ++step) {
        const int64_t local = shares[step][static_cast<size_t>(rank)];
        if (step == 1 && !skip) {
          continue;
        }
        ddp.setBatch(local, kGlobal);
        rollback.capture();
        // A generator of its own: the ranks are threads, and the global one is shared.
        auto generator = at::make_generator<at::CPUGeneratorImpl>(
            static_cast<uint64_t>(100 * step + static_cast<size_t>(rank)));
        const at::Tensor x = at::randn({local, 1, 8, 8}, generator) * static_cast<double>(step + 1);
        model->forward(x).sum().backward();
        if (step == 1) {  // skipped (as every rank does on an overflow)
          rollback.restore();
          ddp.putBackStepBuffers();
        } else {
          weights[static_cast<size_t>(rank)] += static_cast<double>(local) / kGlobal;
        }
      }
      means[static_cast<size_t>(rank)] = model->bn->running_mean.clone();
    });
    return std::make_pair(means, weights);
  };
  const auto [synced, syncedWeights] = run(/*skip=*/true);
  const auto [local, weights] = run(/*skip=*/false);
  const at::Tensor expected =
      (local[0] * weights[0] + local[1] * weights[1]) / (weights[0] + weights[1]);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(at::allclose(synced[r], expected, 1e-5, 1e-6))
        << "rank " << r << ": largest difference "
        << (synced[r] - expected).abs().max().item<double>();
  }
}

// The rollback itself: BatchNorm's statistics and the generators' draws of a forward
// are put back, and a restore without a capture since the last one changes nothing.
TEST(StepRollback, PutsBackBuffersAndRandomDraws) {
  torch::manual_seed(1);
  BnNet model;
  model->train();
  hddp::StepRollback rollback(*model, c10::Device(c10::kCPU));
  model->forward(at::randn({4, 1, 8, 8}));
  rollback.capture();
  const at::Tensor mean = model->bn->running_mean.clone();
  const int64_t count = model->bn->num_batches_tracked.item<int64_t>();
  const at::Tensor drawn = at::rand({5});
  model->forward(at::randn({4, 1, 8, 8}) * 3);
  ASSERT_FALSE(at::equal(mean, model->bn->running_mean));
  rollback.restore();
  EXPECT_TRUE(at::equal(mean, model->bn->running_mean));
  EXPECT_EQ(model->bn->num_batches_tracked.item<int64_t>(), count);
  EXPECT_TRUE(at::equal(drawn, at::rand({5}))) << "the generator was not put back";
  model->forward(at::randn({4, 1, 8, 8}));
  const at::Tensor after = model->bn->running_mean.clone();
  rollback.restore();  // nothing captured since the last restore
  EXPECT_TRUE(at::equal(after, model->bn->running_mean));
}

}  // namespace
