// PowerSGD's steps that are not applied leave no trace (hddp/ddp/power_sgd.h): a step
// abandoned after an out-of-memory error is undone by discardStep(), and a step that
// overflowed in any bucket leaves every bucket's memories as they were.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
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

// Without warm start every compressed step draws its starting Q afresh, seeded by draw
// number k of mt19937_64(randomSeed), which the hook keeps running per thread. Another
// state drawing in between (another seed), a state loaded from a state file mid-run, and
// a step discarded and taken again must draw what a run alone draws, bit for bit.
TEST(PowerSgd, WithoutWarmStartInterleavedStatesDrawWhatARunAloneDraws) {
  constexpr int kSteps = 7;
  auto optionsOf = [](uint64_t seed) {
    hddp::PowerSgdOptions o;
    o.startStep = 2;
    o.warmStart = false;
    o.randomSeed = seed;
    return o;
  };
  // seed -> rank -> step -> the reduced buckets of a run alone (seed 11, then seed 12)
  std::map<uint64_t, std::vector<std::vector<std::vector<at::Tensor>>>> alone;
  alone[11].resize(2);
  alone[12].resize(2);
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    for (uint64_t seed : {11, 12}) {
      auto hook = hddp::powerSgdHook(std::make_shared<hddp::PowerSgdState>(optionsOf(seed)));
      for (int step = 0; step < kSteps; ++step) {
        auto buckets = bucketsOf(rank, step, seed == 11 ? 1.0 : 2.0);
        runStep(hook, *comm, buckets);
        alone[seed][rank].push_back({buckets[0].buffer, buckets[1].buffer});
      }
    }
  });
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    auto mine = std::make_shared<hddp::PowerSgdState>(optionsOf(11));
    auto other = std::make_shared<hddp::PowerSgdState>(optionsOf(12));
    auto mineHook = hddp::powerSgdHook(mine);
    auto otherHook = hddp::powerSgdHook(other);
    std::shared_ptr<hddp::PowerSgdState> loaded;
    hddp::CommHook loadedHook;
    for (int step = 0; step < kSteps; ++step) {
      auto theirs = bucketsOf(rank, step, 2.0);
      runStep(otherHook, *comm, theirs);
      for (size_t i = 0; i < theirs.size(); ++i) {
        EXPECT_TRUE(at::equal(theirs[i].buffer, alone[12][rank][step][i]))
            << "seed 12, step " << step << " bucket " << i;
      }
      if (step == 4) {  // taken, discarded, taken again
        auto abandoned = bucketsOf(rank, 400 + step);
        runStep(mineHook, *comm, abandoned);
        mine->discardStep();
      }
      auto buckets = bucketsOf(rank, step);
      runStep(mineHook, *comm, buckets);
      for (size_t i = 0; i < buckets.size(); ++i) {
        EXPECT_TRUE(at::equal(buckets[i].buffer, alone[11][rank][step][i]))
            << "step " << step << " bucket " << i;
      }
      if (loaded) {
        auto again = bucketsOf(rank, step);
        runStep(loadedHook, *comm, again);
        for (size_t i = 0; i < again.size(); ++i) {
          EXPECT_TRUE(at::equal(again[i].buffer, alone[11][rank][step][i]))
              << "loaded, step " << step << " bucket " << i;
        }
      }
      if (step == 2) {  // a state file's state, taken after the second draw
        loaded = std::make_shared<hddp::PowerSgdState>(optionsOf(11));
        loaded->loadStateDict(mine->stateDict());
        loadedHook = hddp::powerSgdHook(loaded);
      }
    }
    EXPECT_EQ(mine->stateDict().size(), loaded->stateDict().size());
  });
}

// A communicator that runs out of memory issuing its `failAt`-th allreduce (1-based),
// as a device staging a collective's buffer may: nothing of that one is sent.
class OutOfMemoryAtAllreduce final : public hddp::Communicator {
 public:
  OutOfMemoryAtAllreduce(std::unique_ptr<hddp::Communicator> inner, int failAt)
      : inner_(std::move(inner)), failAt_(failAt) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  hddp::Backend backend() const override { return inner_->backend(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  c10::Device device() const override { return inner_->device(); }
  using hddp::Communicator::allreduce;
  using hddp::Communicator::broadcast;
  using hddp::Communicator::reduceScatter;
  hddp::Work allreduce(at::Tensor& tensor, const hddp::AllreduceOptions& options) override {
    count();
    return inner_->allreduce(tensor, options);
  }
  hddp::Work allreduceCoalesced(std::vector<at::Tensor>& tensors,
                                const hddp::AllreduceOptions& options) override {
    count();
    return inner_->allreduceCoalesced(tensors, options);
  }
  hddp::Work broadcast(at::Tensor& tensor, const hddp::BroadcastOptions& options) override {
    return inner_->broadcast(tensor, options);
  }
  hddp::Work allgather(std::vector<at::Tensor>& outputs, const at::Tensor& input,
                       const hddp::AllgatherOptions& options) override {
    return inner_->allgather(outputs, input, options);
  }
  hddp::Work reduceScatter(at::Tensor& output, const at::Tensor& input,
                           const hddp::ReduceScatterOptions& options) override {
    return inner_->reduceScatter(output, input, options);
  }
  hddp::Work barrier(const hddp::BarrierOptions& options) override {
    return inner_->barrier(options);
  }
  int issued() const { return issued_; }

 private:
  void count() {
    TORCH_CHECK_WITH(OutOfMemoryError, ++issued_ != failAt_, "test: out of memory issuing");
  }
  std::unique_ptr<hddp::Communicator> inner_;
  int failAt_;
  int issued_ = 0;
};

// P sent in another type than the gradients (float on float64) takes two collectives:
// the uncompressed gradients, then P. Out of memory issuing P, after the first was sent,
// must not look like an out-of-memory error that DDP answers by sending the bucket
// again (this rank would send one collective more than its peers): it is an error that
// ends the step, and the state is as before it.
TEST(PowerSgd, OutOfMemoryAfterAFirstCollectiveWasSentIsNotRepeatable) {
  auto store = hddp::Store::memory();
  // Steps 0 and 1 send one allreduce each; step 2's first round sends the float64 bias
  // (3rd), then P (4th, fails).
  OutOfMemoryAtAllreduce comm(hddp::makeCommunicator(store, 0, 1), 4);
  hddp::PowerSgdOptions o;
  o.startStep = 2;
  o.wireType = at::kFloat;
  auto state = std::make_shared<hddp::PowerSgdState>(o);
  auto hook = hddp::powerSgdHook(state);
  auto bucketAt = [](int step) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(step);
    return std::vector<hddp::GradBucket>{makeBucket(
        0, true, kFirst, at::randn({16 * 12 + 5}, generator, at::TensorOptions(at::kDouble)))};
  };
  for (int step = 0; step < 2; ++step) {
    auto buckets = bucketAt(step);
    runStep(hook, comm, buckets);
  }
  const StateDict before = stateOf(*state);
  auto buckets = bucketAt(2);
  try {
    hook(comm, buckets[0]);
    ADD_FAILURE() << "the hook went on after its P could not be sent";
  } catch (const c10::OutOfMemoryError& e) {
    ADD_FAILURE() << "an out-of-memory error DDP would repeat the bucket for: " << e.what();
  } catch (const hddp::DistributedError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be repeated"), std::string::npos) << e.what();
  }
  EXPECT_EQ(comm.issued(), 4);
  expectSameState(before, stateOf(*state), "after the failed first round");
}

}  // namespace
