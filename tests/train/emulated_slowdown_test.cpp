// An emulated slower card spreads its extra compute over the step as a real one does
// (hddp/balance/emulation.h, #48): forward's after forward, backward's before each
// bucket is sent (DdpOptions::beforeBucketLaunch), and measure() sleeps only the rest.
// The sleeps are recorded, never slept: no test here needs the machine's speed.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "hddp/balance/emulation.h"
#include "hddp/comm/communicator.h"
#include "hddp/core/step_timer.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "support/ranks.h"

namespace {

using hddp::testing::runThreads;

// A clock that moves only when told: the "compute" between marks and the recorded sleeps.
struct FakeTime {
  double now = 100.0;
  double queued = 0.0;
  std::vector<double> sleeps;
  hddp::Emulator make(double slowdown) {
    hddp::EmulationOptions o;
    o.slowdown = slowdown;
    return hddp::Emulator(
        o, 1,
        [this](std::chrono::duration<double> d) {
          sleeps.push_back(d.count());
          now += d.count();
        },
        hddp::Emulator::Clocks{[this] { return now; }, [this] { return queued; }});
  }
};

// Rank 1, 3x slower: 0.1 s of forward, 0.05 s of backward to the first bucket, 0.03 s to
// the second (of which 0.01 s queued for a core), 0.02 s after it (the optimizer). Each
// mark sleeps 2x its part as it ends; measure() takes those sleeps out of the timer's
// compute and sleeps only the rest, so the sum is 2x the real compute, as before.
TEST(EmulatedSlowdown, TheStretchIsSleptPerPartAndMeasureSleepsOnlyTheRest) {
  FakeTime t;
  hddp::Emulator em = t.make(3.0);
  const double start = t.now;
  em.beginStep(7, 16);
  t.now += 0.1;
  em.endForward();
  t.now += 0.05;
  em.beforeBucketLaunch(0);
  t.now += 0.03;
  t.queued += 0.01;
  em.beforeBucketLaunch(1);
  ASSERT_EQ(t.sleeps.size(), 3u);
  EXPECT_NEAR(t.sleeps[0], 0.2, 1e-12) << "forward's stretch, right after forward";
  EXPECT_NEAR(t.sleeps[1], 0.1, 1e-12) << "bucket 0's part of backward, before its launch";
  EXPECT_NEAR(t.sleeps[2], 0.04, 1e-12) << "bucket 1's part, the queued 0.01 s not stretched";
  EXPECT_NEAR(em.sleptInStep(7), 0.34, 1e-12);
  t.now += 0.02;
  // What the host timer measured: everything from start to stop, the marks' sleeps in it.
  hddp::StepTiming timing;
  timing.label = hddp::StepLabel{7, 16, 0};
  timing.totalSeconds = t.now - start;
  timing.queuedSeconds = 0.01;
  const auto m = em.measure(timing);
  const double real = 0.2;  // 0.1 + 0.05 + 0.03 + 0.02
  const double own = real - 0.01;
  ASSERT_EQ(t.sleeps.size(), 4u);
  EXPECT_NEAR(t.sleeps[3], 2.0 * own - 0.34, 1e-12) << "measure() sleeps only the remainder";
  double total = 0;
  for (double s : t.sleeps) {
    total += s;
  }
  EXPECT_NEAR(total, 2.0 * own, 1e-12) << "in all, (k - 1) x the compute";
  EXPECT_NEAR(m.emulatedSeconds, 2.0 * own, 1e-12);
  EXPECT_NEAR(m.measurement.computeSeconds, real + 2.0 * own, 1e-12)
      << "the planner learns the emulated card's compute, the marks' sleeps counted once";
  EXPECT_NEAR(m.computeSeconds, real + 2.0 * own, 1e-12);
  EXPECT_EQ(em.sleptInStep(7), 0.0) << "handed over with the step's timing";
  // After the step, a bucket launched outside a step (none begun) sleeps nothing.
  em.beforeBucketLaunch(0);
  EXPECT_EQ(t.sleeps.size(), 4u);
}

// A rank at full speed, a rank without samples and a repeated step: nothing is slept by
// the marks, and a step begun again (after an out-of-memory abandon) starts afresh.
TEST(EmulatedSlowdown, MarksSleepOnlyForASlowedRankWithSamples) {
  FakeTime fast;
  hddp::Emulator full = fast.make(1.0);
  full.beginStep(0, 8);
  fast.now += 0.1;
  full.endForward();
  full.beforeBucketLaunch(0);
  EXPECT_TRUE(fast.sleeps.empty());
  FakeTime slow;
  hddp::Emulator em = slow.make(2.0);
  em.beginStep(0, 0);  // no samples in this step
  slow.now += 0.1;
  em.beforeBucketLaunch(0);
  EXPECT_TRUE(slow.sleeps.empty());
  em.beginStep(1, 8);
  slow.now += 0.1;
  em.endForward();
  EXPECT_NEAR(em.sleptInStep(1), 0.1, 1e-12);
  em.beginStep(1, 8);  // abandoned and repeated
  EXPECT_EQ(em.sleptInStep(1), 0.0);
  slow.now += 0.05;
  em.beforeBucketLaunch(0);
  EXPECT_NEAR(em.sleptInStep(1), 0.05, 1e-12);
}

struct Mlp : torch::nn::Module {
  Mlp() {
    for (int i = 0; i < 4; ++i) {
      layers.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(16, 16)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) {
      x = torch::tanh(l->forward(x));
    }
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};

// Two ranks, rank 1 emulated 3x slower, DDP with a bucket per layer: on rank 1 every
// bucket's launch comes right after a sleep (its part of backward, stretched), forward's
// sleep comes before any launch, and the sleeps add up to 2x the real compute, the
// marks' and measure()'s together. Rank 0 sleeps nothing.
TEST(EmulatedSlowdown, EachBucketLeavesAfterItsStretchedPartOfBackward) {
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto comm = hddp::makeCommunicator(store, rank, size);
    at::set_num_threads(1);
    torch::manual_seed(3);
    Mlp model;
    std::vector<std::string> log;  // this rank's sleeps and launches, in order
    double slept = 0;
    hddp::EmulationOptions e;
    e.slowdown = rank == 1 ? 3.0 : 1.0;
    hddp::Emulator em(
        e, rank,
        [&](std::chrono::duration<double> d) {
          log.push_back("sleep");
          slept += d.count();
        },
        hddp::Emulator::Clocks{{}, [] { return 0.0; }});
    hddp::DdpOptions o;
    o.firstBucketBytes = 16 * 16 * 4 + 16 * 4;  // one layer's weight and bias a bucket
    o.bucketCapBytes = o.firstBucketBytes;
    o.beforeBucketLaunch = [&em](int bucket) { em.beforeBucketLaunch(bucket); };
    o.commHook = [&log](hddp::Communicator& c, hddp::GradBucket& bucket) {
      log.push_back("launch " + std::to_string(bucket.index));
      return hddp::CommHookResult{c.allreduce(bucket.buffer), nullptr};
    };
    hddp::DistributedDataParallel ddp(model, *comm, o);
    auto timer = hddp::makeHostStepTimer();
    const auto x = torch::randn({8, 16});
    timer->start(hddp::StepLabel{0, 8, 0});
    em.beginStep(0, 8);
    ddp.setBatch(8, 16);
    auto loss = model.forward(x).pow(2).mean();
    em.endForward();
    log.push_back("backward");
    loss.backward();
    timer->stop();
    const int buckets = ddp.lastStepStats().buckets;
    ASSERT_GE(buckets, 4);
    if (rank == 0) {
      EXPECT_EQ(slept, 0.0);
      EXPECT_EQ(std::count(log.begin(), log.end(), "sleep"), 0);
      return;
    }
    ASSERT_GE(log.size(), 2u);
    EXPECT_EQ(log[0], "sleep") << "forward's stretch comes right after forward";
    EXPECT_EQ(log[1], "backward");
    int launches = 0;
    for (size_t i = 2; i < log.size(); ++i) {
      if (log[i].rfind("launch ", 0) == 0) {
        EXPECT_EQ(log[i - 1], "sleep") << log[i] << " was not preceded by its sleep";
        EXPECT_EQ(log[i], "launch " + std::to_string(launches)) << "launch order";
        ++launches;
      }
    }
    EXPECT_EQ(launches, buckets);
    const double marks = em.sleptInStep(0);
    EXPECT_NEAR(marks, slept, 1e-12);
    EXPECT_GT(marks, 0.0);
    auto timings = timer->collect();
    ASSERT_EQ(timings.size(), 1u);
    hddp::StepTiming t = timings[0];
    const double real = t.computeSeconds();  // the sleeps were recorded, not slept
    t.totalSeconds += marks;                 // where they would have been: inside the timer's span
    t.queuedSeconds = 0;                     // as the injected queue clock says
    const auto m = em.measure(t);
    EXPECT_NEAR(slept, 2.0 * real, 1e-9) << "the marks and measure() sleep (k - 1) x compute";
    EXPECT_NEAR(m.emulatedSeconds, 2.0 * real, 1e-9);
    EXPECT_NEAR(m.measurement.computeSeconds, 3.0 * real, 1e-9);
  });
}

}  // namespace
