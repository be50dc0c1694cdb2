// DistributedSampler: every sample exactly once per epoch under changing plans, the
// minimum share, resuming mid-epoch, and its state in an archive.
#include "hddp/data/distributed_sampler.h"

#include <gtest/gtest.h>
#include <torch/serialize/archive.h>

#include <random>
#include <set>
#include <sstream>
#include <vector>

#include "hddp/balance/batch_plan.h"
#include "hddp/core/error.h"

namespace {

using hddp::BatchPlan;

TEST(DistributedSampler, EverySampleOncePerEpochUnderChangingPlans) {
  for (int world : {1, 2, 3, 4}) {
    for (bool dropLast : {false, true}) {
      const int64_t N = 103;
      hddp::SamplerOptions so;
      so.seed = 5;
      so.dropLast = dropLast;
      std::vector<hddp::DistributedSampler> samplers(world, hddp::DistributedSampler(N, so));
      std::mt19937 rng(world);
      std::multiset<int64_t> seen;
      int64_t steps = 0;
      const int64_t B = 16;
      while (!samplers[0].epochDone(B)) {
        // A new random plan each step, zero shares included.
        BatchPlan plan;
        plan.global = B;
        int64_t left = B;
        for (int r = 0; r < world - 1; ++r) {
          plan.local.push_back(std::uniform_int_distribution<int64_t>(0, left)(rng));
          left -= plan.local.back();
        }
        plan.local.push_back(left);
        for (int r = 0; r < world; ++r) {
          auto share = samplers[r].next(plan, r);
          EXPECT_EQ(static_cast<int64_t>(share.indices.size()), share.localBatch);
          seen.insert(share.indices.begin(), share.indices.end());
        }
        ++steps;
      }
      const int64_t expected = dropLast ? (N / B) * B : N;
      EXPECT_EQ(static_cast<int64_t>(seen.size()), expected) << "world " << world;
      EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), seen.size())
          << "a sample was used twice";
      EXPECT_EQ(steps, dropLast ? N / B : (N + B - 1) / B);
    }
  }
}

// With a minimum share (SyncBatchNorm), a rest too small to give every rank a sample
// joins the step before: every step keeps every rank, every sample is used once.
TEST(DistributedSampler, MinimumShareMergesATinyRestIntoTheStepBefore) {
  for (int world : {2, 3}) {
    const int64_t B = 16;
    const int64_t N = 3 * B + world - 1;
    hddp::BatchPlan plan;
    plan.global = B;
    plan.local = world == 2 ? std::vector<int64_t>{15, 1} : std::vector<int64_t>{8, 1, 7};
    hddp::SamplerOptions so;
    so.minLocalBatch = 1;
    std::vector<hddp::DistributedSampler> samplers(world, hddp::DistributedSampler(N, so));
    std::vector<int> used(N, 0);
    int steps = 0;
    while (!samplers[0].epochDone(B)) {
      ++steps;
      int64_t global = -1;
      for (int r = 0; r < world; ++r) {
        const auto share = samplers[r].next(plan, r);
        EXPECT_GE(share.localBatch, 1) << "world " << world << " step " << steps << " rank " << r;
        global = share.globalBatch;
        for (int64_t i : share.indices) {
          ++used[i];
        }
      }
      EXPECT_EQ(global, steps == 3 ? B + world - 1 : B);
    }
    EXPECT_EQ(steps, 3) << "world " << world;
    for (int64_t i = 0; i < N; ++i) {
      EXPECT_EQ(used[i], 1) << "sample " << i;
    }
  }
}

TEST(DistributedSampler, StateSavesAndLoadsThroughAnArchive) {
  torch::serialize::OutputArchive out;
  hddp::DistributedSampler::State{3, 417}.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  const std::string text = bytes.str();
  torch::serialize::InputArchive in;
  in.load_from(text.data(), text.size());
  const auto state = hddp::DistributedSampler::State::load(in);
  EXPECT_EQ(state.epoch, 3);
  EXPECT_EQ(state.position, 417);
  torch::serialize::InputArchive empty;
  EXPECT_THROW(hddp::DistributedSampler::State::load(empty), hddp::StateError);
}

TEST(DistributedSampler, ResumesMidEpochAndReshufflesPerEpoch) {
  hddp::DistributedSampler a(50, {});
  auto plan = hddp::equalSplit(2, 10);
  a.next(plan, 0);
  a.next(plan, 0);
  auto saved = a.state();
  auto third = a.next(plan, 1);
  hddp::DistributedSampler b(50, {});
  b.restore(saved);
  EXPECT_EQ(b.next(plan, 1).indices, third.indices);
  a.setEpoch(1);
  hddp::DistributedSampler c(50, {});
  EXPECT_NE(a.next(plan, 0).indices, c.next(plan, 0).indices) << "epoch 1 reused epoch 0's order";
  hddp::DistributedSampler::State bad{0, 51};
  EXPECT_THROW(c.restore(bad), hddp::Error);
}

}  // namespace
