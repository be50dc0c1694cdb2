// An emulated slow link under the collectives (hddp/comm/link_emulation.h): each
// collective completes no sooner than a ring over the link would end it; collectives
// share the link; completion callbacks wait for it too. (Bounds from below are exact,
// the sleep guarantees them; bounds from above leave room for a loaded machine.)
#include "hddp/comm/link_emulation.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>

#include "hddp/comm/communicator.h"
#include "hddp/comm/wait_observer.h"
#include "hddp/core/error.h"
#include "support/ranks.h"

namespace {

using Clock = std::chrono::steady_clock;
using hddp::testing::runThreads;

double secondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

TEST(LinkEmulation, RingFormulas) {
  hddp::LinkEmulation link{1e9, 10e-6};
  using K = hddp::CollectiveKind;
  EXPECT_DOUBLE_EQ(hddp::emulatedCollectiveSeconds(K::Allreduce, 4e6, 4, link),
                   2.0 * 3.0 / 4.0 * 4e6 / 1e9 + 6 * 10e-6);
  EXPECT_DOUBLE_EQ(hddp::emulatedCollectiveSeconds(K::Allgather, 1e6, 4, link),
                   3.0 * 1e6 / 1e9 + 3 * 10e-6);
  EXPECT_DOUBLE_EQ(hddp::emulatedCollectiveSeconds(K::ReduceScatter, 4e6, 4, link),
                   3.0 / 4.0 * 4e6 / 1e9 + 3 * 10e-6);
  EXPECT_DOUBLE_EQ(hddp::emulatedCollectiveSeconds(K::Broadcast, 1e6, 4, link),
                   1e6 / 1e9 + 3 * 10e-6);
  EXPECT_DOUBLE_EQ(hddp::emulatedCollectiveSeconds(K::Barrier, 0, 4, link), 6 * 10e-6);
  EXPECT_EQ(hddp::emulatedCollectiveSeconds(K::Allreduce, 4e6, 1, link), 0.0) << "one rank";
  EXPECT_EQ(hddp::emulatedCollectiveSeconds(K::Allreduce, 4e6, 4, {}), 0.0) << "off";
}

// Two ranks, a 2 MB allreduce over 20 MB/s: a ring sends it once each way, 100 ms. Two
// allreduces issued back to back share the link: the second ends 200 ms after the
// first began. The wait is told to the wait observers, and the completion callback
// runs no sooner than the emulated end.
TEST(LinkEmulation, CollectivesTakeTheRingTimeAndShareTheLink) {
  runThreads(2, [&](int rank, int size, hddp::Store& store) {
    auto inner = hddp::makeCommunicator(store, rank, size);
    auto comm = hddp::emulateLink(*inner, hddp::LinkEmulation{20e6, 0.0});
    struct Observer : hddp::WaitObserver {
      std::atomic<int> waits{0};
      void beginWait() override { ++waits; }
      void endWait() override {}
    } observer;
    auto handle = comm->addWaitObserver(observer);
    at::Tensor a = at::ones({500000});  // 2 MB
    at::Tensor b = at::ones({500000});
    comm->barrier().wait();
    const auto start = Clock::now();
    std::atomic<double> callbackAt{-1.0};
    hddp::Work first = comm->allreduce(a);
    first.onCompletion([&callbackAt, start] { callbackAt = secondsSince(start); });
    hddp::Work second = comm->allreduce(b);
    first.wait();
    const double firstDone = secondsSince(start);
    EXPECT_TRUE(first.isCompleted());
    second.wait();
    const double secondDone = secondsSince(start);
    EXPECT_GE(firstDone, 0.100);
    EXPECT_LT(firstDone, 0.100 * 1.5);
    EXPECT_GE(secondDone, 0.200);
    EXPECT_LT(secondDone, 0.200 * 1.5);
    for (int i = 0; i < 100 && callbackAt.load() < 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_GE(callbackAt.load(), 0.100) << "the callback ran before the emulated end";
    EXPECT_EQ(a[0].item<float>(), 2.0f) << "the sum went through";
    EXPECT_GE(observer.waits.load(), 2);
    EXPECT_THROW(hddp::emulateLink(*inner, hddp::LinkEmulation{-1.0, 0.0}), hddp::ConfigError);
    EXPECT_THROW(hddp::emulateLink(*inner, hddp::LinkEmulation{1e9, -1.0}), hddp::ConfigError);
  });
}
