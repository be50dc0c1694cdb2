// PlanSampler: hddp's unequal shares through LibTorch's own make_data_loader, every
// sample once per epoch across the ranks under a plan that changes within an epoch,
// with and without the loader's worker threads; no empty batch; resuming mid-epoch.
#include "hddp/data/plan_sampler.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <sstream>
#include <vector>

#include "hddp/balance/batch_plan.h"
#include "hddp/core/error.h"

namespace {

using hddp::BatchPlan;

// Sample i is the number i, so a batch shows which samples it holds.
class Numbers : public torch::data::datasets::Dataset<Numbers> {
 public:
  explicit Numbers(int64_t n) : n_(n) {}
  torch::data::Example<> get(size_t index) override {
    return {torch::tensor({static_cast<int64_t>(index)}), torch::tensor(int64_t(0))};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(n_); }

 private:
  int64_t n_;
};

BatchPlan planOf(std::vector<int64_t> local) {
  BatchPlan p;
  p.local = std::move(local);
  for (int64_t b : p.local) {
    p.global += b;
  }
  return p;
}

std::vector<int64_t> numbersIn(const torch::Tensor& data) {
  const torch::Tensor flat = data.reshape({-1}).contiguous();
  return std::vector<int64_t>(flat.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + flat.numel());
}

auto makeLoader(int64_t n, const hddp::PlanSampler& sampler, int workers) {
  return torch::data::make_data_loader(
      Numbers(n).map(torch::data::transforms::Stack<>()), sampler,
      torch::data::DataLoaderOptions().batch_size(99).workers(static_cast<size_t>(workers)));
}

// Three ranks, each with its own torch loader over the same dataset, iterated in lockstep
// as the ranks of a job step together; the plan changes on every rank after step 2.
TEST(PlanSampler, MakeDataLoaderGivesEachRankItsShareAndEverySampleOncePerEpoch) {
  const int64_t N = 100;  // 8 steps of 12, then one of 4
  const int world = 3;
  const BatchPlan first = planOf({2, 7, 3});
  const BatchPlan second = planOf({6, 1, 5});
  for (int workers : {0, 2}) {
    std::vector<hddp::PlanSampler> samplers;
    for (int r = 0; r < world; ++r) {
      hddp::SamplerOptions so;
      so.seed = 11;
      samplers.emplace_back(N, first, r, so);
    }
    std::vector<decltype(makeLoader(N, samplers[0], workers))> loaders;
    for (int r = 0; r < world; ++r) {
      loaders.push_back(makeLoader(N, samplers[static_cast<size_t>(r)], workers));
    }
    std::vector<std::vector<int64_t>> orders;  // each epoch's samples in step order
    std::set<std::vector<int64_t>> plansSeen;
    for (int epoch = 0; epoch < 2; ++epoch) {
      for (auto& s : samplers) {
        s.setPlan(first);
      }
      std::vector<decltype(loaders[0]->begin())> its;
      for (auto& l : loaders) {
        its.push_back(l->begin());
      }
      std::vector<int64_t> order;
      for (int step = 0;; ++step) {
        const bool done = its[0] == loaders[0]->end();
        for (int r = 1; r < world; ++r) {
          ASSERT_EQ(its[static_cast<size_t>(r)] == loaders[static_cast<size_t>(r)]->end(), done)
              << "the ranks' loaders disagree on the number of steps";
        }
        if (done) {
          break;
        }
        int64_t global = 0;
        int64_t globalOfRank0 = 0;
        for (int r = 0; r < world; ++r) {
          const size_t ur = static_cast<size_t>(r);
          const auto& batch = *its[ur];
          const hddp::StepShare share = samplers[ur].stepOfBatch();
          EXPECT_EQ(share.plan.local[ur], share.localBatch);
          EXPECT_GE(share.localBatch, 1) << "torch's loader cannot hand out an empty batch";
          ASSERT_EQ(batch.data.size(0), share.localBatch) << "rank " << r << " step " << step;
          const auto numbers = numbersIn(batch.data);
          EXPECT_EQ(numbers, share.indices);
          order.insert(order.end(), numbers.begin(), numbers.end());
          global += share.localBatch;
          if (r == 0) {
            plansSeen.insert(share.plan.local);
            globalOfRank0 = share.globalBatch;
          }
          EXPECT_EQ(share.globalBatch, globalOfRank0) << "the ranks disagree on the step";
          ++its[ur];
        }
        EXPECT_EQ(global, globalOfRank0) << "the shares sum to the step's global batch";
        if (step == 1) {
          for (auto& s : samplers) {
            s.setPlan(second);  // the steps asked for from now on
          }
        }
      }
      std::vector<int64_t> sorted = order;
      std::sort(sorted.begin(), sorted.end());
      std::vector<int64_t> all(static_cast<size_t>(N));
      for (int64_t i = 0; i < N; ++i) {
        all[static_cast<size_t>(i)] = i;
      }
      EXPECT_EQ(sorted, all) << "epoch " << epoch << ", workers " << workers
                             << ": every sample exactly once";
      orders.push_back(order);
    }
    EXPECT_NE(orders[0], orders[1]) << "each pass over the loader starts the next epoch";
    EXPECT_TRUE(plansSeen.count(first.local) && plansSeen.count(second.local))
        << "workers " << workers << ": the new plan was used within the epoch";
  }
}

// A plan may give a rank nothing (the planner's idle rank); torch's loader asserts on an
// empty batch, so the sampler takes a sample from the largest share for it.
TEST(PlanSampler, ARankThePlanGivesNothingStillGetsASample) {
  const BatchPlan plan = planOf({0, 10});
  hddp::PlanSampler rank0(30, plan, 0);
  hddp::PlanSampler rank1(30, plan, 1);
  auto l0 = makeLoader(30, rank0, 0);
  auto l1 = makeLoader(30, rank1, 0);
  auto i0 = l0->begin();
  auto i1 = l1->begin();
  ASSERT_FALSE(i0 == l0->end());
  ASSERT_FALSE(i1 == l1->end());
  EXPECT_EQ((*i0).data.size(0), 1);
  EXPECT_EQ((*i1).data.size(0), 9);
  const hddp::StepShare s0 = rank0.stepOfBatch();
  EXPECT_EQ(s0.plan.local, (std::vector<int64_t>{1, 9}));
  EXPECT_EQ(s0.globalBatch, 10);
}

// A program that saves mid-epoch (the loader has asked for steps ahead) and resumes in a
// new loader gets the rest of the epoch: nothing twice, nothing lost.
TEST(PlanSampler, ResumesMidEpochFromItsArchiveCountingOnlyTheBatchesHandedOut) {
  const int64_t N = 23;
  const BatchPlan plan = planOf({5});
  std::vector<int64_t> seen;
  std::stringstream saved;
  {
    hddp::PlanSampler sampler(N, plan, 0);
    sampler.setEpoch(3);
    auto loader = makeLoader(N, sampler, 2);  // asks for 4 steps ahead
    auto it = loader->begin();
    for (int step = 0; step < 2; ++step, ++it) {
      const auto numbers = numbersIn((*it).data);
      seen.insert(seen.end(), numbers.begin(), numbers.end());
      sampler.stepOfBatch();
    }
    EXPECT_EQ(sampler.state().epoch, 3);
    EXPECT_EQ(sampler.state().position, 10);
    torch::serialize::OutputArchive archive;
    sampler.save(archive);
    archive.save_to(saved);
  }
  hddp::PlanSampler resumed(N, plan, 0);
  torch::serialize::InputArchive archive;
  archive.load_from(saved);
  resumed.load(archive);
  auto loader = makeLoader(N, resumed, 2);
  for (auto& batch : *loader) {
    const auto numbers = numbersIn(batch.data);
    seen.insert(seen.end(), numbers.begin(), numbers.end());
    resumed.stepOfBatch();
  }
  EXPECT_EQ(resumed.epoch(), 3);
  std::sort(seen.begin(), seen.end());
  std::vector<int64_t> all(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) {
    all[static_cast<size_t>(i)] = i;
  }
  EXPECT_EQ(seen, all);
  // The next pass is the next epoch, from its beginning.
  int64_t count = 0;
  for (auto& batch : *loader) {
    count += batch.data.size(0);
    resumed.stepOfBatch();
  }
  EXPECT_EQ(count, N);
  EXPECT_EQ(resumed.epoch(), 4);
}

// PyTorch's habit: load the archive, then setEpoch(epoch) at the top of each epoch. The
// epoch loaded resumes where it stood (it used to restart at 0, training the first
// samples twice); setEpoch to another epoch starts that one from its beginning.
TEST(PlanSampler, SetEpochOfTheLoadedEpochKeepsThePositionAnotherDropsIt) {
  const int64_t N = 23;
  const BatchPlan plan = planOf({5});
  std::vector<int64_t> first;
  std::stringstream saved;
  {
    hddp::PlanSampler sampler(N, plan, 0);
    sampler.setEpoch(3);
    auto loader = makeLoader(N, sampler, 0);
    auto it = loader->begin();
    for (int step = 0; step < 2; ++step, ++it) {
      const auto numbers = numbersIn((*it).data);
      first.insert(first.end(), numbers.begin(), numbers.end());
      sampler.stepOfBatch();
    }
    torch::serialize::OutputArchive archive;
    sampler.save(archive);
    archive.save_to(saved);
  }
  const auto restOfEpoch = [&](int64_t epochAfterLoad) {
    hddp::PlanSampler resumed(N, plan, 0);
    torch::serialize::InputArchive archive;
    std::stringstream copy(saved.str());
    archive.load_from(copy);
    resumed.load(archive);
    resumed.setEpoch(epochAfterLoad);
    resumed.setEpoch(epochAfterLoad);  // twice, as a loop might: the same
    std::vector<int64_t> rest;
    auto loader = makeLoader(N, resumed, 0);
    for (auto& batch : *loader) {
      const auto numbers = numbersIn(batch.data);
      rest.insert(rest.end(), numbers.begin(), numbers.end());
      resumed.stepOfBatch();
    }
    EXPECT_EQ(resumed.epoch(), epochAfterLoad);
    return rest;
  };
  std::vector<int64_t> seen = first;
  const std::vector<int64_t> rest = restOfEpoch(3);
  EXPECT_EQ(rest.size(), static_cast<size_t>(N - 10)) << "the loaded epoch restarted";
  seen.insert(seen.end(), rest.begin(), rest.end());
  std::sort(seen.begin(), seen.end());
  std::vector<int64_t> all(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) {
    all[static_cast<size_t>(i)] = i;
  }
  EXPECT_EQ(seen, all) << "exactly the samples the save had not used";
  // Another epoch: the whole of it.
  std::vector<int64_t> other = restOfEpoch(4);
  std::sort(other.begin(), other.end());
  EXPECT_EQ(other, all);
}

TEST(PlanSampler, MisuseIsAnErrorThatSaysWhatToDo) {
  hddp::PlanSampler sampler(10, planOf({4, 4}), 1);
  try {
    sampler.stepOfBatch();
    FAIL() << "no batch was handed out";
  } catch (const hddp::ConfigError& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("once for each batch"),
              std::string::npos);
  }
  EXPECT_THROW(hddp::PlanSampler(10, planOf({4, 4}), 2), hddp::ConfigError);  // rank 2 of 2
  EXPECT_THROW(sampler.setPlan(planOf({1})), hddp::ConfigError);              // rank 1 not in it
  try {
    sampler.setPlan(planOf({1, 0}));
    FAIL() << "a global batch of 1 cannot give 2 ranks a sample";
  } catch (const hddp::ConfigError& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("cannot hand out an empty batch"),
              std::string::npos);
  }
  hddp::PlanSampler copy = sampler;  // a copy (the loader's) shares the state
  auto loader = makeLoader(10, copy, 0);
  auto it = loader->begin();
  ASSERT_FALSE(it == loader->end());
  EXPECT_EQ(sampler.stepOfBatch().localBatch, 4);
}

}  // namespace

namespace {

// Two ranks step through an epoch of 40 in steps of 16 with torch's loader (no workers);
// at the second step (and again at the epoch's last, partial step) they repeat it under a
// new split, as after running out of memory: the repeat holds the same samples, the
// epoch still serves every sample once among the steps that stood, and the position a
// save writes counts the step once.
TEST(PlanSampler, RepeatLastStepServesTheSameSamplesUnderTheNewSplit) {
  hddp::PlanSampler r0(40, planOf({8, 8}), 0);
  hddp::PlanSampler r1(40, planOf({8, 8}), 1);
  auto l0 = makeLoader(40, r0, 0);
  auto l1 = makeLoader(40, r1, 0);
  std::vector<int64_t> stood;
  std::vector<std::vector<int64_t>> repeatedFirst;
  std::vector<std::vector<int64_t>> repeatedThen;
  int step = 0;
  bool repeating = false;
  auto i0 = l0->begin();
  auto i1 = l1->begin();
  for (; i0 != l0->end() && i1 != l1->end(); ++i0, ++i1, ++step) {
    std::vector<int64_t> both = numbersIn((*i0).data);
    const auto b1 = numbersIn((*i1).data);
    both.insert(both.end(), b1.begin(), b1.end());
    std::sort(both.begin(), both.end());
    const hddp::StepShare s0 = r0.stepOfBatch();
    r1.stepOfBatch();
    if ((step == 1 || step == 3) && !repeating) {  // "out of memory": repeat, 10 / 6
      repeatedFirst.push_back(both);
      const BatchPlan split = s0.globalBatch == 16 ? planOf({10, 6}) : planOf({5, 3});
      r0.setPlan(split);
      r1.setPlan(split);
      r0.repeatLastStep();
      r1.repeatLastStep();
      repeating = true;
      continue;
    }
    if (repeating) {
      repeatedThen.push_back(both);
      EXPECT_EQ(s0.localBatch, s0.globalBatch == 16 ? 10 : 5);
      repeating = false;
    }
    stood.insert(stood.end(), both.begin(), both.end());
  }
  EXPECT_EQ(repeatedFirst, repeatedThen);  // the same samples, under the new split
  ASSERT_EQ(repeatedFirst.size(), 2u);
  std::sort(stood.begin(), stood.end());
  std::vector<int64_t> all(40);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(stood, all);
  EXPECT_EQ(r0.state().position, 40);
}

TEST(PlanSampler, RepeatLastStepNeedsAStepAndALoaderThatDidNotAskAhead) {
  hddp::PlanSampler fresh(40, planOf({8, 8}), 0);
  EXPECT_THROW(fresh.repeatLastStep(), hddp::ConfigError);  // nothing handed out yet
  {  // after a load, or once the pass has ended, there is no step to repeat
    hddp::PlanSampler s(16, planOf({8, 8}), 0);
    auto l = makeLoader(16, s, 0);
    auto it = l->begin();
    ASSERT_FALSE(it == l->end());
    s.stepOfBatch();
    ++it;  // the epoch of one step has ended
    EXPECT_TRUE(it == l->end());
    EXPECT_THROW(s.repeatLastStep(), hddp::ConfigError);
    hddp::PlanSampler t(40, planOf({8, 8}), 0);
    auto lt = makeLoader(40, t, 0);
    ASSERT_FALSE(lt->begin() == lt->end());
    t.stepOfBatch();
    std::stringstream bytes;
    torch::serialize::OutputArchive out;
    t.save(out);
    out.save_to(bytes);
    torch::serialize::InputArchive in;
    in.load_from(bytes);
    t.load(in);
    EXPECT_THROW(t.repeatLastStep(), hddp::ConfigError);
  }
  hddp::PlanSampler ahead(40, planOf({8, 8}), 0);
  auto loader = makeLoader(40, ahead, 2);  // 2 workers: 4 steps asked for ahead
  auto it = loader->begin();
  ASSERT_FALSE(it == loader->end());
  ahead.stepOfBatch();
  try {
    ahead.repeatLastStep();
    ADD_FAILURE() << "a repeat went through with steps asked for ahead";
  } catch (const hddp::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("workers(0)"), std::string::npos) << e.what();
  }
}

}  // namespace
