// A loop of one's own with the Trainer's public parts and no Trainer: out-of-memory
// recovery (hddp/train/out_of_memory.h) with the step rollback, around DDP and a planner.
// Rank 1 runs out of memory above 12 samples: every rank gives the step up together, the
// cap is learned 10% at a time (16 -> 15 -> 14 -> 13 -> 12), and the same samples are
// trained again each time. The given-up steps leave no trace: the run ends with the
// parameters and BatchNorm statistics of a straight run that had the cap from the start
// (the random draws' put-back is StepRollback.PutsBackBuffersAndRandomDraws's: the ranks
// here are threads sharing one generator).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>
#include <utility>
#include <vector>

#include "hddp/balance/planner.h"
#include "hddp/comm/communicator.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "hddp/train/out_of_memory.h"
#include "hddp/train/step_rollback.h"
#include "support/ranks.h"

using hddp::testing::runThreads;

namespace {

constexpr int64_t kGlobal = 32;
constexpr int64_t kSteps = 4;

std::mutex initMutex;  // the ranks are threads of one process: one seeded init at a time

torch::nn::Sequential makeModel() {
  std::lock_guard<std::mutex> lock(initMutex);
  torch::manual_seed(11);
  torch::nn::Sequential model(torch::nn::Linear(16, 8), torch::nn::BatchNorm1d(8),
                              torch::nn::Functional(torch::relu), torch::nn::Linear(8, 4));
  model->to(at::kDouble);
  return model;
}

// Step s's global batch: the same on every rank.
std::pair<at::Tensor, at::Tensor> globalBatch(int64_t s) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + static_cast<uint64_t>(s));
  at::Tensor x = at::randn({kGlobal, 16}, gen, at::kDouble);
  at::Tensor y = at::randint(0, 4, {kGlobal}, gen, at::kLong);
  return {x, y};
}

struct LoopEnd {
  std::vector<at::Tensor> state;  // parameters, then buffers
  int64_t repeated = 0;
  std::vector<int64_t> plan;
};

// The loop on `rank`; `learn`: rank 1 runs out of memory above 12 samples and the cap is
// learned; else the cap is 12 from the start and nothing fails.
LoopEnd trainLoop(int rank, int size, hddp::Store& store, bool learn) {
  auto comm = hddp::makeCommunicator(store, rank, size);
  auto model = makeModel();
  hddp::DistributedDataParallel ddp(model.ptr(), *comm);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  hddp::PlannerSettings settings;
  settings.rebalanceEvery = 1000;  // the split moves by the memory caps only
  hddp::BatchPlanner planner(*comm, hddp::PlannerOptions(kGlobal, settings));
  if (!learn) {
    planner.setMemoryCap(1, 12);
  }
  hddp::StepRollback rollback(*model, c10::Device(c10::kCPU));
  hddp::OutOfMemoryRecovery recovery(*comm, ddp, &planner, &rollback, c10::Device(c10::kCPU));
  int64_t step = 0;
  while (step < kSteps) {
    const auto batch = globalBatch(step);
    const hddp::BatchPlan plan = planner.plan();
    const int64_t local = plan.local[static_cast<size_t>(rank)];
    const int64_t offset = plan.offsetOf(rank);
    ddp.setBatch(local, kGlobal);
    opt.zero_grad();
    rollback.capture();
    recovery.run([&] {
      // The forward runs (BatchNorm's statistics move) before the failure.
      const at::Tensor out = model->forward(batch.first.narrow(0, offset, local));
      TORCH_CHECK_WITH(OutOfMemoryError, rank != 1 || local <= 12, "test: out of memory at ", local,
                       " samples");
      torch::nn::functional::cross_entropy(out, batch.second.narrow(0, offset, local)).backward();
    });
    comm->synchronize();
    if (const auto outcome = recovery.afterBackward(local, step + 1)) {
      EXPECT_EQ(outcome->failures.size(), 1u);
      EXPECT_EQ(outcome->failures[0].rank, 1);
      continue;  // the same global batch again, under the new split
    }
    opt.step();
    ++step;
  }
  LoopEnd run;
  for (const auto& p : model->parameters()) {
    run.state.push_back(p.detach().clone());
  }
  for (const auto& b : model->buffers()) {
    run.state.push_back(b.detach().clone().to(at::kDouble));
  }
  run.repeated = recovery.repeatedSteps();
  run.plan = planner.plan().local;
  return run;
}

TEST(OutOfMemoryRecovery, AHandWrittenLoopRepeatsTheStepAndEndsAsAStraightRunOfTheNewSplit) {
  std::vector<LoopEnd> learned(2);
  std::vector<LoopEnd> straight(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    learned[static_cast<size_t>(rank)] = trainLoop(rank, size, store, /*learn=*/true);
  });
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    straight[static_cast<size_t>(rank)] = trainLoop(rank, size, store, /*learn=*/false);
  });
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(learned[r].repeated, 4);  // 16, 15, 14, 13 failed; 12 fits
    EXPECT_EQ(straight[r].repeated, 0);
    EXPECT_EQ(learned[r].plan, (std::vector<int64_t>{20, 12}));
    EXPECT_EQ(straight[r].plan, learned[r].plan);
    ASSERT_EQ(learned[r].state.size(), straight[r].state.size());
    for (size_t i = 0; i < learned[r].state.size(); ++i) {
      EXPECT_TRUE(at::allclose(learned[r].state[i], straight[r].state[i], 1e-12, 1e-12))
          << "rank " << r << ", tensor " << i << " (parameters first, then buffers)";
    }
  }
}

}  // namespace
