// The step timers on their own: the host timer's wait spans and run-queue time, and the
// device timer's stream waits on CUDA and on hddp::emu (split from step_timing_test.cpp).
#include "hddp/core/step_timer.h"

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "hddp/comm/communicator.h"
#include "hddp/core/error.h"
#include "support/emulated_device.h"

namespace {

TEST(StepTiming, HostTimerLeavesWaitSpansOut) {
  auto timer = hddp::makeHostStepTimer();
  EXPECT_TRUE(timer->collect().empty());
  timer->start({3, 10, 100});
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  timer->beginWait();
  std::this_thread::sleep_for(std::chrono::milliseconds(40));
  timer->endWait();
  timer->beginWait();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  timer->endWait();
  timer->stop();
  const auto t = timer->collect();
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].label.step, 3);
  EXPECT_EQ(t[0].label.samples, 10);
  EXPECT_GE(t[0].waitSeconds, 0.055);
  EXPECT_GE(t[0].totalSeconds, t[0].waitSeconds + 0.018);
  EXPECT_LT(t[0].computeSeconds(), t[0].totalSeconds - 0.055);
  EXPECT_TRUE(timer->collect().empty());  // each step once
  // A step never stopped (abandoned) is dropped by the next start().
  timer->start({4, 10, 0});
  timer->start({5, 10, 0});
  timer->stop();
  const auto next = timer->collect();
  ASSERT_EQ(next.size(), 1u);
  EXPECT_EQ(next[0].label.step, 5);
}

// More spinning threads than cores: the timed thread, spinning too, waits in the run
// queue for a good part of its step, and the host timer says how long (what the
// emulator leaves unstretched). Alone, it barely waits.
TEST(StepTiming, HostTimerMeasuresTimeWithoutACore) {
  if (hddp::threadQueuedSeconds() < 0) {
    GTEST_SKIP() << "no /proc/thread-self/schedstat here";
  }
  auto spin = [](double seconds) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < end) {
    }
  };
  auto timer = hddp::makeHostStepTimer();
  std::atomic<bool> stop{false};
  std::vector<std::thread> others;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  for (unsigned i = 0; i < cores; ++i) {
    others.emplace_back([&] {
      while (!stop.load()) {
      }
    });
  }
  timer->start({1, 1, 0});
  spin(0.4);
  timer->stop();
  stop = true;
  for (auto& t : others) {
    t.join();
  }
  const auto t = timer->collect();
  ASSERT_EQ(t.size(), 1u);
  // cores + 1 spinning threads on `cores` cores: about 1/(cores + 1) of the time queued.
  EXPECT_GT(t[0].queuedSeconds, 0.25 / (cores + 1) * t[0].totalSeconds) << t[0].totalSeconds;
  EXPECT_LE(t[0].queuedSeconds, t[0].computeSeconds());
}

TEST(StepTiming, DeviceTimerRefusesTheCpu) {
  EXPECT_THROW(hddp::makeDeviceStepTimer(c10::Device(c10::kCPU)), hddp::ConfigError);
  EXPECT_STREQ(hddp::makeStepTimer(c10::Device(c10::kCPU))->describe(), "host clock");
}

#define SKIP_WITHOUT_CUDA()                                                                \
  if (!torch::cuda::is_available() || !hddp::ncclAvailable()) {                            \
    GTEST_SKIP() << "needs a CUDA device and the NCCL build (run tools/gpu-check.sh on a " \
                    "GPU machine)";                                                        \
  }

// One step on `dev` timed by the device timer: a little compute, a "collective" that
// `launch` queues on another stream (recording `done` there), the compute stream waiting
// for it through the event, a little more compute. The timer must count that span as
// waiting and the rest as compute, and hand the step over only once its events have
// completed. Returns the step's timing.
hddp::StepTiming timeAStreamWait(const c10::Device& dev, const char* describe,
                                 const std::function<void(c10::Event& done)>& launch) {
  auto timer = hddp::makeStepTimer(dev);
  EXPECT_STREQ(timer->describe(), describe);
  auto small = torch::randn({64, 64}, torch::TensorOptions().device(dev));
  c10::impl::VirtualGuardImpl guard(dev.type());
  guard.synchronizeDevice(dev.index());
  const c10::Stream compute = guard.getStream(dev);
  const c10::Stream other = guard.getStreamFromGlobalPool(dev, false);
  timer->start({0, 8, 0});
  for (int i = 0; i < 5; ++i) {
    small = small.mm(small).tanh();  // a little compute
  }
  c10::Event done(dev.type());
  {
    c10::StreamGuard on(other);
    launch(done);
  }
  timer->beginWait();
  done.block(compute);
  timer->endWait();
  for (int i = 0; i < 5; ++i) {
    small = small.mm(small).tanh();
  }
  timer->stop();
  guard.synchronizeDevice(dev.index());
  const auto t = timer->collect();
  EXPECT_EQ(t.size(), 1u);
  if (t.empty()) {
    return {};
  }
  EXPECT_GT(t[0].waitSeconds, 5 * t[0].computeSeconds())
      << "total " << t[0].totalSeconds << " s, wait " << t[0].waitSeconds << " s";
  EXPECT_GT(t[0].computeSeconds(), 0.0);
  EXPECT_GT(t[0].tailSeconds, 0.0);
  return t[0];
}

// On a device the wait is on the stream: the compute stream waits (event block) for a
// long kernel on another stream, as it waits for NCCL's; the host returns at once.
TEST(StepTiming, DeviceTimerLeavesTheStreamWaitOut_CUDA) {
  SKIP_WITHOUT_CUDA();
  const c10::Device dev(c10::kCUDA, 0);
  auto a = torch::randn({2048, 2048}, torch::TensorOptions().device(dev));
  const auto t = timeAStreamWait(dev, "cuda:0 events", [&](c10::Event& done) {
    auto b = a;  // the "collective": 40 large matmuls on the other stream
    for (int i = 0; i < 40; ++i) {
      b = b.mm(a).tanh();
    }
    done.record(c10::impl::VirtualGuardImpl(c10::kCUDA).getStream(dev));
  });
  EXPECT_GT(t.waitSeconds, 0.0);
}

// The twin on hddp::emu: the "collective" is a copy queued on a side stream that runs
// 1 s later (emu's stream delay), long enough that the compute around it (on the CPU,
// 0.15 s under CI's load) stays under a fifth of it.
TEST(StepTiming, DeviceTimerLeavesTheStreamWaitOut_Emu) {
  const c10::Device dev = hddp::testing::emulatedDevice(0);
  auto host = torch::randn({1 << 20});
  auto a = torch::empty({1 << 20}, torch::TensorOptions().device(dev));
  hddp::emu::setStreamDelay(std::chrono::milliseconds(1000));
  const auto t = timeAStreamWait(dev, "emu:0 events", [&](c10::Event& done) {
    a.copy_(host, /*non_blocking=*/true);  // runs 1 s later on the side stream
    done.record(c10::impl::VirtualGuardImpl(dev.type()).getStream(dev));
  });
  hddp::emu::setStreamDelay(std::chrono::milliseconds(0));
  EXPECT_GE(t.waitSeconds, 0.9) << "total " << t.totalSeconds << " s";
  EXPECT_TRUE(torch::equal(a.cpu(), host));
}

}  // namespace
