// An emulated slow link under the collectives (hddp/comm/link_emulation.h): each
// collective completes no sooner than a ring over the link would end it; collectives
// share the link; completion callbacks wait for it too. (Bounds from below are exact,
// the sleep guarantees them; bounds from above leave room for a loaded machine.)
#include "hddp/comm/link_emulation.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "hddp/comm/communicator.h"
#include "hddp/comm/wait_observer.h"
#include "hddp/core/error.h"
#include "support/emulated_device.h"
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

namespace {

// A peer that sends nothing and is done at once (as NCCL's host side, which returns
// before the device has run anything): what is left to see is the emulated link's time.
class InstantCommunicator final : public hddp::Communicator {
 public:
  explicit InstantCommunicator(c10::Device device) : device_(device) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  hddp::Backend backend() const override { return hddp::Backend::Nccl; }
  std::chrono::milliseconds timeout() const override { return std::chrono::seconds(60); }
  c10::Device device() const override { return device_; }
  using Communicator::allreduce;
  using Communicator::broadcast;
  using Communicator::reduceScatter;
  hddp::Work allreduce(at::Tensor&, const hddp::AllreduceOptions&) override { return {}; }
  hddp::Work allreduceCoalesced(std::vector<at::Tensor>&, const hddp::AllreduceOptions&) override {
    return {};
  }
  hddp::Work broadcast(at::Tensor&, const hddp::BroadcastOptions&) override { return {}; }
  hddp::Work allgather(std::vector<at::Tensor>&, const at::Tensor&,
                       const hddp::AllgatherOptions&) override {
    return {};
  }
  hddp::Work reduceScatter(at::Tensor&, const at::Tensor&,
                           const hddp::ReduceScatterOptions&) override {
    return {};
  }
  hddp::Work barrier(const hddp::BarrierOptions&) override { return {}; }

 private:
  c10::Device device_;
};

}  // namespace

// On a device the host issues a collective before the device has computed its input
// (a gradient still queued behind backward's kernels): the emulated ring starts when an
// event recorded on the input's stream completes, not at the issue. Here the input is
// written by a copy queued on a side stream that runs at least 1 s later (emu delays
// each task queued on a side stream), over a link that takes 100 ms: the Work completes
// no sooner than 1.1 s after the issue, its completion callback too, and a second
// collective behind it shares the link. (Without the event: 0.1 s and 0.2 s.)
TEST(LinkEmulation, TheRingStartsWhenTheInputIsReadyOnTheDevice_Emu) {
  const c10::Device dev = hddp::testing::emulatedDevice(0);
  InstantCommunicator inner(dev);
  auto comm = hddp::emulateLink(inner, hddp::LinkEmulation{20e6, 0.0});
  const c10::impl::VirtualGuardImpl guard(dev.type());
  const c10::Stream side = guard.getNewStream(dev);
  auto host = torch::ones({500000});  // 2 MB: over 2 ranks a ring sends it once, 100 ms
  hddp::emu::setStreamDelay(std::chrono::milliseconds(1000));
  {
    const c10::StreamGuard onSide(side);
    auto grad = torch::empty({500000}, torch::TensorOptions().device(dev));
    const auto start = Clock::now();
    grad.copy_(host, /*non_blocking=*/true);  // computed on the device 1 s from now
    hddp::Work first = comm->allreduce(grad);
    std::atomic<double> callbackAt{-1.0};
    first.onCompletion([&callbackAt, start] { callbackAt = secondsSince(start); });
    // Completed now only if the host was held up past the input and the ring (a loaded
    // machine): the test needs no speed.
    const bool completedNow = first.isCompleted();
    EXPECT_TRUE(!completedNow || secondsSince(start) >= 1.0 + 0.100)
        << "completed before its input existed";
    hddp::Work second = comm->allreduce(grad);
    first.wait();
    const double firstDone = secondsSince(start);
    second.wait();
    const double secondDone = secondsSince(start);
    EXPECT_GE(firstDone, 1.0 + 0.100) << "the ring started before the input was ready";
    EXPECT_GE(secondDone, 1.0 + 0.200) << "the second did not wait for the link";
    for (int i = 0; i < 200 && callbackAt.load() < 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_GE(callbackAt.load(), 1.0 + 0.100) << "the callback ran before the emulated end";
    EXPECT_TRUE(first.isCompleted());
  }
  hddp::emu::setStreamDelay(std::chrono::milliseconds(0));
  guard.synchronizeDevice(dev.index());
  // A CPU tensor is ready when issued: its ring starts at once.
  InstantCommunicator onHost{c10::Device(c10::kCPU)};
  auto hostComm = hddp::emulateLink(onHost, hddp::LinkEmulation{20e6, 0.0});
  auto t = torch::ones({500000});
  const auto start = Clock::now();
  hddp::Work w = hostComm->allreduce(t);
  w.wait();
  EXPECT_GE(secondsSince(start), 0.100);
}
