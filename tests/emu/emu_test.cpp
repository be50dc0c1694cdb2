// hddp::emu: devices, operators, factories, the allocator, pinned memory, the slowdown and
// the options.

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cmath>
#include <cstdlib>
#include <thread>

#include "emu_fixture.h"
#include "support/scoped_env.h"

namespace hddp {
namespace emu {
namespace testing {
namespace {

constexpr size_t kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);

using EmuDevice = EmuTest;
using EmuOps = EmuTest;
using EmuAllocator = EmuTest;
using EmuPinned = EmuTest;
using EmuSlowdown = EmuTest;

TEST_F(EmuDevice, DeviceStringParsesAndTensorsMoveThereAndBack) {
  const torch::Device d("emu:1");
  EXPECT_TRUE(d.is_privateuseone());
  EXPECT_EQ(d.index(), 1);
  EXPECT_EQ(d.str(), "emu:1");
  const auto cpu = torch::arange(12, torch::kFloat).reshape({3, 4});
  const auto there = cpu.to("emu:1");
  EXPECT_EQ(there.device(), d);
  const auto other = there.to(emuDevice(0));
  EXPECT_EQ(other.device(), emuDevice(0));
  EXPECT_TRUE(torch::equal(other.cpu(), cpu));
  EXPECT_EQ(deviceCount(), 2);
}

TEST_F(EmuDevice, AMissingDeviceIsRejectedWithTheCount) {
  EXPECT_TRUE(throwsWith([] { torch::zeros({2}, torch::Device("emu:5")); }, "2 emulated devices"));
}

TEST_F(EmuOps, ElementwiseReductionIndexingAndMatmulEqualCpu) {
  torch::manual_seed(1);
  const auto a = torch::randn({5, 7});
  const auto b = torch::randn({7, 3});
  const auto ea = a.to(emuDevice(0));
  const auto eb = b.to(emuDevice(0));
  EXPECT_TRUE(torch::allclose(ea.matmul(eb).cpu(), a.matmul(b)));
  EXPECT_TRUE(torch::allclose((ea * 2 + 1).relu().cpu(), (a * 2 + 1).relu()));
  EXPECT_TRUE(torch::allclose(ea.sum(1).cpu(), a.sum(1)));
  EXPECT_TRUE(torch::equal(ea.argmax(1).cpu(), a.argmax(1)));
  EXPECT_TRUE(torch::equal(ea.t().contiguous().cpu(), a.t().contiguous()));
  EXPECT_TRUE(torch::equal(ea.index({torch::indexing::Slice(1, 3)}).cpu(),
                           a.index({torch::indexing::Slice(1, 3)})));
  EXPECT_FLOAT_EQ(ea.sum().item<float>(), a.sum().item<float>());
  auto inplace = ea.clone();
  inplace.add_(1.5).mul_(2);
  EXPECT_TRUE(torch::allclose(inplace.cpu(), (a + 1.5) * 2));
  EXPECT_TRUE(torch::equal(ea.view({35}).cpu(), a.view({35})));
}

TEST_F(EmuOps, MixingTwoEmuDevicesInOneOperatorIsRefusedAsOnCuda) {
  const auto a = torch::ones({3}, emuDevice(0));
  const auto b = torch::ones({3}, emuDevice(1));
  EXPECT_TRUE(throwsWith([&] { (void)(a + b); }, "Expected all tensors to be on the same device"));
}

TEST_F(EmuOps, MixingACpuTensorWithEmuTensorsIsRefusedNamingBothDevicesAsOnCuda) {
  torch::manual_seed(2);
  const auto weight = torch::randn({4, 3}, emuDevice(0));
  const auto batch = torch::randn({5, 3});  // left on the CPU, as a forgotten .to(device)
  const auto filters = torch::randn({2, 3, 3, 3}, emuDevice(0));
  const std::string devices = "found at least two devices, emu:0 and cpu!";
  EXPECT_TRUE(throwsWith([&] { (void)torch::nn::functional::linear(batch, weight); }, devices));
  EXPECT_TRUE(throwsWith([&] { (void)batch.matmul(weight.t()); }, devices));
  EXPECT_TRUE(throwsWith(
      [&] {
        (void)torch::conv2d(torch::randn({1, 3, 8, 8}), filters);
      },
      devices));
  EXPECT_TRUE(throwsWith(  // emu input, CPU weight: emu's own convolution kernel
      [&] {
        (void)torch::conv2d(torch::randn({1, 3, 8, 8}, emuDevice(0)), filters.cpu());
      },
      devices));
  EXPECT_TRUE(throwsWith([&] { (void)(weight + torch::ones({4, 3})); }, devices));
  EXPECT_TRUE(throwsWith([&] { (void)(torch::ones({4, 3}) + weight); }, devices));
  EXPECT_TRUE(throwsWith([&] { (void)weight.matmul(batch.t()); }, ".to(emu:0)"));
}

TEST_F(EmuOps, CpuScalarsAndCpuIndexTensorsMixWithEmuTensorsAsOnCuda) {
  const auto a = torch::arange(6, torch::kFloat).reshape({2, 3});
  const auto e = a.to(emuDevice(1));
  const auto two = torch::tensor(2.0);  // a 0-dim CPU tensor: a scalar to CUDA kernels
  const auto product = e * two;
  EXPECT_EQ(product.device(), emuDevice(1));
  EXPECT_TRUE(torch::equal(product.cpu(), a * 2));
  const auto scalarFirst = two * e;
  EXPECT_EQ(scalarFirst.device(), emuDevice(1));
  EXPECT_TRUE(torch::equal(scalarFirst.cpu(), a * 2));
  const auto chosen = torch::where(torch::tensor(true), e, e);  // a CPU scalar first
  EXPECT_EQ(chosen.device(), emuDevice(1));
  const auto sum = e.add(two);
  EXPECT_EQ(sum.device(), emuDevice(1));
  EXPECT_TRUE(torch::equal(sum.cpu(), a + 2));
  const auto rows = torch::tensor({1, 0, 1}, torch::kLong);
  const auto picked = e.index({rows});
  EXPECT_EQ(picked.device(), emuDevice(1));
  EXPECT_TRUE(torch::equal(picked.cpu(), a.index({rows})));
  auto target = e.clone();
  target.index_put_({torch::tensor({0}, torch::kLong)}, torch::tensor(-1.0));
  EXPECT_TRUE(torch::equal(target.cpu()[0], torch::full({3}, -1.0)));
  const auto mask = a > 2;
  EXPECT_TRUE(torch::equal(e.index({mask}).cpu(), a.index({mask})));
}

TEST_F(EmuOps, FactoryFunctionsCreateTensorsOnEmu) {
  const auto z = torch::zeros({3, 2}, emuDevice(1));
  EXPECT_EQ(z.device(), emuDevice(1));
  EXPECT_TRUE(torch::equal(z.cpu(), torch::zeros({3, 2})));
  EXPECT_TRUE(torch::equal(torch::ones({4}, emuDevice(0)).cpu(), torch::ones({4})));
  EXPECT_TRUE(torch::equal(torch::arange(5, torch::TensorOptions().device(emuDevice(0))).cpu(),
                           torch::arange(5)));
  EXPECT_TRUE(torch::equal(torch::full({2}, 7.0, emuDevice(0)).cpu(), torch::full({2}, 7.0)));
  torch::manual_seed(3);
  const auto onEmu = torch::randn({8}, emuDevice(0));
  torch::manual_seed(3);
  const auto onCpu = torch::randn({8});
  EXPECT_EQ(onEmu.device(), emuDevice(0));
  EXPECT_TRUE(torch::equal(onEmu.cpu(), onCpu));  // emu draws from the CPU generator
}

// A factory or out= operator for emu:1, issued while the thread's current device is emu:0
// (a rank on emu:1 that never set its current device, as a Gloo rank on cuda:1 need not):
// the result lies on emu:1, as on CUDA. Before, arange's out= result grew through
// resize_, which took memory from the current device, and the tensor moved to emu:0.
TEST_F(EmuOps, ResultsLieOnTheRequestedDeviceNotTheCurrentOne) {
  c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->setDevice(emuDevice(0));
  const auto options = torch::TensorOptions().device(emuDevice(1)).dtype(torch::kLong);
  const auto ids = torch::arange(3, options);
  EXPECT_EQ(ids.device(), emuDevice(1));
  auto grown = torch::empty({0}, options);
  grown.resize_({5});
  EXPECT_EQ(grown.device(), emuDevice(1));
  const auto sum = (ids + torch::ones({3}, options)).sum();
  EXPECT_EQ(sum.device(), emuDevice(1));
  EXPECT_EQ(sum.item<int64_t>(), 6);
}

// A process that computes on emu:1 only (a rank, hddp::emu::setOwnDevice): an allocation
// that takes a thread's current device, emu:0, is a violation naming both devices and
// where it was made; allocations on emu:1 are not.
TEST_F(EmuAllocator, AnAllocationOffTheOwnDeviceIsAViolationNamingWhereItWasMade) {
  EXPECT_EQ(ownDevice(), -1);
  EXPECT_TRUE(throwsWith([] { setOwnDevice(2); }, "emu:2 does not exist"));
  setOwnDevice(1);
  std::thread([] {
    c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->setDevice(emuDevice(0));
    EXPECT_EQ(torch::ones({2}, emuDevice(1)).sum().item<float>(), 2.0f);  // on emu:1: fine
    EXPECT_TRUE(violations().empty());
    const auto stray =
        torch::empty({3}, torch::TensorOptions().device(c10::DeviceType::PrivateUse1));
    EXPECT_EQ(stray.device(), emuDevice(0));
  }).join();
  setOwnDevice(-1);
  const auto found = violations();
  ASSERT_EQ(found.size(), 1u);
  EXPECT_NE(found[0].find("computes on emu:1"), std::string::npos) << found[0];
  EXPECT_NE(found[0].find("12 bytes on emu:0"), std::string::npos) << found[0];
  EXPECT_NE(found[0].find("Allocated at:"), std::string::npos) << found[0];
  clearViolations();
}

TEST_F(EmuOps, FreshDeviceMemoryHoldsThePoisonPattern) {
  const auto e = torch::empty({16}, emuDevice(0));
  EXPECT_TRUE(e.cpu().isnan().all().item<bool>());
}

TEST_F(EmuAllocator, StatsFollowAllocationsAndPeaksReset) {
  auto* allocator = c10::getDeviceAllocator(c10::DeviceType::PrivateUse1);
  const auto before = allocator->getDeviceStats(0).allocated_bytes[kAggregate].current;
  auto t = torch::empty({1024}, torch::TensorOptions().dtype(torch::kFloat).device(emuDevice(0)));
  auto stats = allocator->getDeviceStats(0);
  EXPECT_EQ(stats.allocated_bytes[kAggregate].current, before + 4096);
  EXPECT_EQ(stats.reserved_bytes[kAggregate].current, before + 4096);  // nothing is cached
  EXPECT_GE(stats.allocated_bytes[kAggregate].peak, before + 4096);
  t = torch::Tensor();
  stats = allocator->getDeviceStats(0);
  EXPECT_EQ(stats.allocated_bytes[kAggregate].current, before);
  EXPECT_GE(stats.allocated_bytes[kAggregate].peak, before + 4096);
  allocator->resetPeakStats(0);
  EXPECT_EQ(allocator->getDeviceStats(0).allocated_bytes[kAggregate].peak, before);
  EXPECT_EQ(allocator->getDeviceStats(1).allocated_bytes[kAggregate].current, 0);
}

TEST_F(EmuAllocator, MemoryInfoReportsTheSettableTotal) {
  auto* allocator = c10::getDeviceAllocator(c10::DeviceType::PrivateUse1);
  EXPECT_EQ(allocator->getMemoryInfo(1).second, size_t{16} << 30);
  setMemoryTotal(1, int64_t{64} << 20);
  const auto t =
      torch::empty({1 << 20}, torch::TensorOptions().dtype(torch::kByte).device(emuDevice(1)));
  const auto [freeBytes, totalBytes] = allocator->getMemoryInfo(1);
  EXPECT_EQ(totalBytes, size_t{64} << 20);
  EXPECT_EQ(freeBytes, (size_t{63} << 20));
  EXPECT_EQ(memoryTotal(1), int64_t{64} << 20);
}

TEST_F(EmuAllocator, AllocationAboveTheTotalThrowsOutOfMemory) {
  setMemoryTotal(1, int64_t{1} << 20);
  const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(emuDevice(1));
  EXPECT_THROW(torch::empty({1 << 20}, opts), c10::OutOfMemoryError);
  try {
    torch::empty({1 << 20}, opts);
  } catch (const c10::OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("emu:1 out of memory: tried to allocate 4.00 MiB"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(torch::empty({1 << 10}, opts));
  EXPECT_NO_THROW(torch::empty({1 << 20}, opts.device(emuDevice(0))));  // emu:0 keeps 16 GiB
}

TEST_F(EmuPinned, PinMemoryAndIsPinnedWorkWithAndWithoutADevice) {
  const auto plain = torch::arange(6, torch::kFloat);
  EXPECT_FALSE(plain.is_pinned());
  const auto pinned = plain.pin_memory();
  EXPECT_TRUE(pinned.is_pinned());
  EXPECT_TRUE(pinned.is_cpu());
  EXPECT_TRUE(torch::equal(pinned, plain));
  const auto pinnedForEmu = plain.pin_memory(torch::Device("emu:0"));
  EXPECT_TRUE(pinnedForEmu.is_pinned());
  EXPECT_TRUE(torch::equal(pinnedForEmu, plain));
  const auto empty = torch::empty({3}, torch::TensorOptions().pinned_memory(true));
  EXPECT_TRUE(empty.is_pinned());
}

TEST_F(EmuSlowdown, ASlowDeviceSleepsFactorMinusOneTimesItsComputeTime) {
  setSlowdown(1, 3.0);
  const auto a = torch::randn({64, 64});
  const auto on0 = a.to(emuDevice(0));
  const auto on1 = a.to(emuDevice(1));
  for (int i = 0; i < 5; ++i) {
    (void)on0.matmul(on0);
    (void)on1.matmul(on1);
  }
  const DeviceCounters fast = counters(0);
  const DeviceCounters slow = counters(1);
  EXPECT_GE(fast.ops, 5);
  EXPECT_GE(slow.ops, 5);
  EXPECT_GT(fast.computeSeconds, 0.0);
  EXPECT_EQ(fast.slowdownSeconds, 0.0);
  EXPECT_GT(slow.computeSeconds, 0.0);
  EXPECT_NEAR(slow.slowdownSeconds, 2.0 * slow.computeSeconds, 1e-9);
  resetCounters();
  EXPECT_EQ(counters(1).ops, 0);
}

using hddp::testing::ScopedEnv;

TEST(EmuEnv, OptionsFromEnvReadsEveryVariableAndDefaultsTheRest) {
  {
    ScopedEnv noDevices("HDDP_EMU_DEVICES", nullptr);
    ScopedEnv noSlowdown("HDDP_EMU_SLOWDOWN", nullptr);
    ScopedEnv noMemory("HDDP_EMU_MEMORY_GIB", nullptr);
    ScopedEnv noDelay("HDDP_EMU_STREAM_DELAY_MS", nullptr);
    const EmuOptions o = optionsFromEnv();
    EXPECT_EQ(o.deviceCount, 2);
    EXPECT_TRUE(o.slowdown.empty());
    EXPECT_EQ(o.memoryBytes, int64_t{16} << 30);
    EXPECT_EQ(o.streamDelay.count(), 0);
  }
  ScopedEnv devices("HDDP_EMU_DEVICES", "3");
  ScopedEnv slowdown("HDDP_EMU_SLOWDOWN", "1:3,2:1.5");
  ScopedEnv memory("HDDP_EMU_MEMORY_GIB", "0.5");
  ScopedEnv delay("HDDP_EMU_STREAM_DELAY_MS", "50");
  const EmuOptions o = optionsFromEnv();
  EXPECT_EQ(o.deviceCount, 3);
  EXPECT_EQ(o.slowdown.size(), 2u);
  EXPECT_DOUBLE_EQ(o.slowdown.at(1), 3.0);
  EXPECT_DOUBLE_EQ(o.slowdown.at(2), 1.5);
  EXPECT_EQ(o.memoryBytes, int64_t{512} << 20);
  EXPECT_EQ(o.streamDelay.count(), 50);
}

TEST(EmuEnv, BadValuesNameTheVariableTheValueAndWhatIsExpected) {
  ScopedEnv noDevices("HDDP_EMU_DEVICES", nullptr);
  {
    ScopedEnv bad("HDDP_EMU_DEVICES", "two");
    EXPECT_TRUE(throwsWith([] { optionsFromEnv(); },
                           "HDDP_EMU_DEVICES='two' is not valid: expected an integer"));
  }
  {
    ScopedEnv bad("HDDP_EMU_DEVICES", "0");
    EXPECT_TRUE(throwsWith([] { optionsFromEnv(); }, "HDDP_EMU_DEVICES='0'"));
  }
  {
    ScopedEnv bad("HDDP_EMU_SLOWDOWN", "1=3");
    EXPECT_TRUE(throwsWith([] { optionsFromEnv(); }, "HDDP_EMU_SLOWDOWN='1=3' is not valid"));
  }
  {
    ScopedEnv bad("HDDP_EMU_SLOWDOWN", "5:2");  // only 2 devices
    EXPECT_TRUE(throwsWith([] { optionsFromEnv(); }, "HDDP_EMU_SLOWDOWN='5:2'"));
  }
  {
    ScopedEnv bad("HDDP_EMU_SLOWDOWN", "1:0.5");
    EXPECT_TRUE(throwsWith([] { optionsFromEnv(); }, "factor >= 1"));
  }
  {
    ScopedEnv bad("HDDP_EMU_MEMORY_GIB", "-1");
    EXPECT_TRUE(throwsWith([] { optionsFromEnv(); }, "HDDP_EMU_MEMORY_GIB='-1' is not valid"));
  }
  {
    ScopedEnv bad("HDDP_EMU_STREAM_DELAY_MS", "1.5");
    EXPECT_TRUE(
        throwsWith([] { optionsFromEnv(); }, "HDDP_EMU_STREAM_DELAY_MS='1.5' is not valid"));
  }
}

TEST_F(EmuDevice, InstallIsIdempotentAndKeepsItsDeviceCount) {
  EXPECT_NO_THROW(install(defaultOptions()));
  EXPECT_TRUE(isInstalled());
  EmuOptions three = defaultOptions();
  three.deviceCount = 3;
  EXPECT_TRUE(throwsWith([&] { install(three); }, "cannot change to 3"));
  EmuOptions badSlowdown = defaultOptions();
  badSlowdown.slowdown[4] = 2.0;
  EXPECT_TRUE(throwsWith([&] { install(badSlowdown); }, "names emu:4"));
  EXPECT_EQ(c10::get_privateuse1_backend(), "emu");
}

}  // namespace
}  // namespace testing
}  // namespace emu
}  // namespace hddp

namespace hddp {
namespace emu {
namespace testing {
namespace {

// BatchNorm in training mode updates its running statistics in place (optional mutable
// arguments of native_batch_norm): on emu as on the CPU.
TEST_F(EmuOps, BatchNormRunningStatisticsFollowTheCpu) {
  torch::manual_seed(3);
  torch::nn::BatchNorm2d cpu(4);
  torch::nn::BatchNorm2d emu(4);
  emu->to(emuDevice(0));
  const auto x = torch::randn({8, 4, 5, 5}) * 3 + 1;
  for (int step = 0; step < 3; ++step) {
    const auto y = cpu->forward(x);
    const auto e = emu->forward(x.to(emuDevice(0)));
    EXPECT_TRUE(torch::allclose(y, e.cpu(), 1e-5, 1e-6));
  }
  EXPECT_TRUE(torch::allclose(cpu->running_mean, emu->running_mean.cpu(), 1e-5, 1e-6))
      << cpu->running_mean << emu->running_mean.cpu();
  EXPECT_TRUE(torch::allclose(cpu->running_var, emu->running_var.cpu(), 1e-5, 1e-6))
      << cpu->running_var << emu->running_var.cpu();
  EXPECT_EQ(emu->num_batches_tracked.cpu().item<int64_t>(), 3);
}

}  // namespace
}  // namespace testing
}  // namespace emu
}  // namespace hddp
