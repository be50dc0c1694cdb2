// PowerSGD's steps that are not applied leave no trace (hddp/ddp/power_sgd.h): a step
// abandoned after an out-of-memory error is undone by discardStep(), and a step that
// overflowed in any bucket leaves every bucket's memories as they were.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/ddp/power_sgd.h"
#include "support/power_sgd_steps.h"
#include "support/ranks.h"

namespace {

using hddp::testing::makeBucket;
using hddp::testing::runStep;
using hddp::testing::runThreads;

using StateDict = std::map<std::string, at::Tensor>;

StateDict stateOf(const hddp::PowerSgdState& state) {
  StateDict out;
  for (const auto& item : state.stateDict()) {
    out[item.first] = item.second;
  }
  return out;
}

// Equal keys and bitwise-equal tensors, except the keys in `except`.
void expectSameState(const StateDict& a, const StateDict& b, const std::string& what,
                     const std::vector<std::string>& except = {}) {
  auto skipped = [&](const std::string& key) {
    for (const auto& e : except) {
      if (e == key) {
        return true;
      }
    }
    return false;
  };
  std::vector<std::string> keysA;
  std::vector<std::string> keysB;
  for (const auto& item : a) {
    keysA.push_back(item.first);
  }
  for (const auto& item : b) {
    keysB.push_back(item.first);
  }
  EXPECT_EQ(keysA, keysB) << what;
  for (const auto& item : a) {
    const auto other = b.find(item.first);
    if (other == b.end() || skipped(item.first)) {
      continue;
    }
    EXPECT_TRUE(at::equal(item.second, other->second)) << what << ": " << item.first;
  }
}

const std::vector<std::vector<int64_t>> kFirst = {{16, 12}, {5}};
const std::vector<std::vector<int64_t>> kSecond = {{10, 20}};

// Two buckets of one step, each rank's gradients drawn from a generator of its own (the
// ranks are threads: the global generator would be drawn from in turns).
std::vector<hddp::GradBucket> bucketsOf(int rank, int step, double scale = 1.0) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(1000 * step + rank);
  return {makeBucket(0, false, kFirst, at::randn({16 * 12 + 5}, generator) * scale),
          makeBucket(1, true, kSecond, at::randn({10 * 20}, generator) * scale)};
}

// A step abandoned and discarded leaves the state as it was before it, count and draws
// included: the run then goes on exactly as the run that never took that step. Checked at
// the first compressed step (Q drawn at random), at a warm-started one, and before
// compression starts (the count alone).
TEST(PowerSgd, DiscardStepRestoresTheStateBeforeTheStep) {
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    hddp::PowerSgdOptions o;
    o.startStep = 2;
    auto straight = std::make_shared<hddp::PowerSgdState>(o);
    auto discarding = std::make_shared<hddp::PowerSgdState>(o);
    auto straightHook = hddp::powerSgdHook(straight);
    auto discardingHook = hddp::powerSgdHook(discarding);
    discarding->discardStep();  // before any step: nothing to undo
    for (int step = 0; step < 6; ++step) {
      if (step == 1 || step == 2 || step == 4) {
        // A step that is then abandoned: other gradients (the split changes after an
        // out-of-memory error), its memories and draws undone.
        const StateDict before = stateOf(*discarding);
        auto abandoned = bucketsOf(rank, 100 + step, 3.0);
        runStep(discardingHook, *comm, abandoned);
        discarding->discardStep();
        expectSameState(before, stateOf(*discarding),
                        "after discarding step " + std::to_string(step));
        EXPECT_EQ(before.at("step").item<int64_t>(), discarding->step());
        discarding->discardStep();  // a second call does nothing
        expectSameState(before, stateOf(*discarding), "after a second discard");
      }
      auto a = bucketsOf(rank, step);
      auto b = bucketsOf(rank, step);
      runStep(straightHook, *comm, a);
      runStep(discardingHook, *comm, b);
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_TRUE(at::equal(a[i].buffer, b[i].buffer)) << "step " << step << " bucket " << i;
      }
      expectSameState(stateOf(*straight), stateOf(*discarding), "step " + std::to_string(step));
    }
    EXPECT_EQ(straight->step(), 6);
  });
}

// An overflow in the first bucket only (inf on one rank): the second bucket's reduced
// gradient is finite, yet its memories must not change either (made at the scale that
// overflowed, they would be off once the GradScaler backs off); only the count goes on.
// Then the next steps equal those of a run that never saw the overflowing step.
TEST(PowerSgd, AnOverflowInOneBucketLeavesEveryBucketAsItWas) {
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    hddp::PowerSgdOptions o;
    o.startStep = 2;
    auto overflowing = std::make_shared<hddp::PowerSgdState>(o);
    auto reference = std::make_shared<hddp::PowerSgdState>(o);
    auto overflowingHook = hddp::powerSgdHook(overflowing);
    auto referenceHook = hddp::powerSgdHook(reference);
    for (int step = 0; step < 7; ++step) {
      if (step == 3) {
        const StateDict before = stateOf(*overflowing);
        auto buckets = bucketsOf(rank, 300);
        if (rank == 1) {
          buckets[0].buffer[7] = std::numeric_limits<float>::infinity();
        }
        runStep(overflowingHook, *comm, buckets);
        EXPECT_FALSE(at::isfinite(buckets[0].buffer).all().item<bool>());
        EXPECT_TRUE(at::isfinite(buckets[1].buffer).all().item<bool>());
        expectSameState(before, stateOf(*overflowing), "after the overflow", {"step"});
        EXPECT_EQ(overflowing->step(), before.at("step").item<int64_t>() + 1);
        // The reference counts the step without taking it.
        auto skipped = bucketsOf(rank, 300);
        runStep(referenceHook, *comm, skipped);
        reference->discardStep();
        reference->loadStateDict([&] {
          auto dict = reference->stateDict();
          for (auto& item : dict) {
            if (item.first == "step") {
              item.second = at::tensor(overflowing->step(), at::kLong);
            }
          }
          return dict;
        }());
        continue;
      }
      auto a = bucketsOf(rank, step);
      auto b = bucketsOf(rank, step);
      runStep(overflowingHook, *comm, a);
      runStep(referenceHook, *comm, b);
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_TRUE(at::equal(a[i].buffer, b[i].buffer)) << "step " << step << " bucket " << i;
      }
      expectSameState(stateOf(*reference), stateOf(*overflowing), "step " + std::to_string(step));
    }
  });
}

}  // namespace
