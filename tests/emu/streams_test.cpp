// hddp::emu: side streams, events and the stream-safety checks. The negative tests show
// that a missing event wait, a missing record_stream and a host read before
// synchronisation are caught or give a visibly wrong result, whatever the timing.

#include <chrono>
#include <thread>

#include "emu_fixture.h"

namespace hddp {
namespace emu {
namespace testing {
namespace {

using EmuStreams = EmuTest;
using EmuEvents = EmuTest;

constexpr int64_t kN = 4096;

torch::Tensor pinnedRamp() { return torch::arange(kN, torch::kFloat).pin_memory(); }

// The data loader's prefetch: a host->emu copy issued on a side stream.
torch::Tensor prefetch(const torch::Tensor& host, c10::Stream side) {
  const c10::StreamGuard guard(side);
  return host.to(emuDevice(0), /*non_blocking=*/true);
}

TEST_F(EmuStreams, SideStreamCopyWithEventWaitGivesTheRightData) {
  setStreamDelay(std::chrono::milliseconds(50));
  const auto side = newSideStream(0);
  const auto host = pinnedRamp();
  auto batch = prefetch(host, side);
  c10::Event ready(c10::DeviceType::PrivateUse1);
  ready.record(side);
  ready.block(defaultStream(0));
  batch.record_stream(defaultStream(0));
  const auto doubled = batch * 2;
  EXPECT_TRUE(torch::equal(doubled.cpu(), host * 2));
  batch = torch::Tensor();
  EXPECT_TRUE(violations().empty());
}

void expectReadWithoutWaitIsCaught(std::chrono::milliseconds delay) {
  setStreamDelay(delay);
  const auto side = newSideStream(0);
  const auto batch = prefetch(pinnedRamp(), side);
  EXPECT_TRUE(throwsWith([&] { (void)(batch * 2); },
                         "Wait on an event recorded after the copy (c10::Event::block)"));
  EXPECT_TRUE(throwsWith([&] { (void)batch.cpu(); }, "side stream"));
}

TEST_F(EmuStreams, SideStreamCopyReadWithoutWaitIsCaughtWithoutDelay) {
  expectReadWithoutWaitIsCaught(std::chrono::milliseconds(0));
}

TEST_F(EmuStreams, SideStreamCopyReadWithoutWaitIsCaughtWithDelay) {
  expectReadWithoutWaitIsCaught(std::chrono::milliseconds(50));
}

TEST_F(EmuStreams, SideStreamCopyReadAfterTheCopyRanIsStillCaught) {
  const auto side = newSideStream(0);
  const auto batch = prefetch(pinnedRamp(), side);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the copy has surely run
  EXPECT_TRUE(throwsWith([&] { (void)(batch + 1); }, "may still be writing"));
}

TEST_F(EmuStreams, HostSynchronizationOrdersLaterWork) {
  setStreamDelay(std::chrono::milliseconds(20));
  const auto side = newSideStream(0);
  const auto host = pinnedRamp();
  const auto batch = prefetch(host, side);
  side.synchronize();
  EXPECT_TRUE(torch::equal((batch + 1).cpu(), host + 1));
}

TEST_F(EmuStreams, OverwritingWhatAnotherStreamStillReadsIsCaught) {
  const auto side = newSideStream(0);
  auto x = torch::ones({kN}, emuDevice(0));
  c10::Event written(c10::DeviceType::PrivateUse1);
  written.record(defaultStream(0));
  written.block(side);
  auto out = torch::empty({kN}, torch::TensorOptions().pinned_memory(true));
  {
    const c10::StreamGuard guard(side);
    out.copy_(x, /*non_blocking=*/true);  // the side stream reads x
  }
  EXPECT_TRUE(throwsWith([&] { x.fill_(3); }, "may still be reading"));
  side.synchronize();
  EXPECT_NO_THROW(x.fill_(3));
  x.record_stream(side);
}

TEST_F(EmuStreams, AMissingRecordStreamIsReportedAsAViolation) {
  const auto side = newSideStream(0);
  auto batch = prefetch(pinnedRamp(), side);
  c10::Event ready(c10::DeviceType::PrivateUse1);
  ready.record(side);
  ready.block(defaultStream(0));
  auto used = batch * 2;    // the default stream uses memory of the side stream's pool
  batch = torch::Tensor();  // freed without batch.record_stream(default stream)
  ASSERT_EQ(violations().size(), 1u);
  EXPECT_NE(violations()[0].find("without record_stream"), std::string::npos) << violations()[0];
  EXPECT_TRUE(throwsWith([] { checkNoViolations(); }, "without record_stream"));
  EXPECT_TRUE(throwsWith([&] { (void)(used + 1); }, "without record_stream"));  // sticky, once
  EXPECT_NO_THROW((void)(used + 1));
  clearViolations();
}

TEST_F(EmuStreams, RecordStreamPreventsTheViolation) {
  const auto side = newSideStream(0);
  auto batch = prefetch(pinnedRamp(), side);
  c10::Event ready(c10::DeviceType::PrivateUse1);
  ready.record(side);
  ready.block(defaultStream(0));
  auto used = batch * 2;
  batch.record_stream(defaultStream(0));
  batch = torch::Tensor();
  EXPECT_TRUE(violations().empty());
  EXPECT_NO_THROW(checkNoViolations());
}

TEST_F(EmuStreams, RecordDataPtrOnStreamPreventsTheViolationToo) {
  const auto side = newSideStream(0);
  auto batch = prefetch(pinnedRamp(), side);
  c10::Event ready(c10::DeviceType::PrivateUse1);
  ready.record(side);
  ready.block(defaultStream(0));
  auto used = batch * 2;
  guardImpl().recordDataPtrOnStream(batch.storage().data_ptr(), defaultStream(0));
  batch = torch::Tensor();
  EXPECT_TRUE(violations().empty());
}

TEST_F(EmuStreams, NonBlockingToCpuOnASideStreamIsPinnedAndFilledOnlyAfterSynchronize) {
  setStreamDelay(std::chrono::milliseconds(300));
  const auto side = newSideStream(0);
  const auto x =
      torch::arange(kN, torch::TensorOptions().dtype(torch::kFloat).device(emuDevice(0)));
  c10::Event written(c10::DeviceType::PrivateUse1);
  written.record(defaultStream(0));
  written.block(side);
  torch::Tensor out;
  {
    const c10::StreamGuard guard(side);
    out = x.to(torch::kCPU, /*non_blocking=*/true);
  }
  EXPECT_TRUE(out.is_pinned());
  EXPECT_TRUE(out.isnan().all().item<bool>());
  side.synchronize();
  EXPECT_TRUE(torch::equal(out, torch::arange(kN, torch::kFloat)));
  x.record_stream(side);
}

TEST_F(EmuStreams, NonBlockingDeviceToHostReadBeforeSynchronizeGivesPoison) {
  // Not caught, but visibly wrong: the destination holds the poison pattern (NaN) until the
  // queued copy ran. The delay makes the copy certainly later than the read.
  setStreamDelay(std::chrono::milliseconds(300));
  const auto side = newSideStream(0);
  const auto x =
      torch::arange(kN, torch::TensorOptions().dtype(torch::kFloat).device(emuDevice(0)));
  c10::Event written(c10::DeviceType::PrivateUse1);
  written.record(defaultStream(0));
  written.block(side);
  auto out = torch::empty({kN}, torch::TensorOptions().pinned_memory(true));
  {
    const c10::StreamGuard guard(side);
    out.copy_(x, /*non_blocking=*/true);
  }
  EXPECT_TRUE(out.isnan().all().item<bool>());  // read before synchronising: wrong
  side.synchronize();
  EXPECT_TRUE(torch::equal(out, torch::arange(kN, torch::kFloat)));
}

TEST_F(EmuStreams, BlockingDeviceToHostCopySynchronizesTheStream) {
  setStreamDelay(std::chrono::milliseconds(50));
  const auto side = newSideStream(0);
  const auto x =
      torch::arange(kN, torch::TensorOptions().dtype(torch::kFloat).device(emuDevice(0)));
  c10::Event written(c10::DeviceType::PrivateUse1);
  written.record(defaultStream(0));
  written.block(side);
  auto out = torch::empty({kN}, torch::TensorOptions().pinned_memory(true));
  {
    const c10::StreamGuard guard(side);
    out.copy_(x, /*non_blocking=*/false);
  }
  EXPECT_TRUE(torch::equal(out, torch::arange(kN, torch::kFloat)));
  x.record_stream(side);
}

TEST_F(EmuStreams, PinnedSourceFreedBeforeTheQueuedCopyRanIsKeptAlive) {
  setStreamDelay(std::chrono::milliseconds(100));
  const auto side = newSideStream(0);
  auto host = pinnedRamp();
  auto batch = prefetch(host, side);
  host = torch::Tensor();  // the copy has not run yet
  side.synchronize();
  EXPECT_TRUE(torch::equal(batch.cpu(), torch::arange(kN, torch::kFloat)));
}

TEST_F(EmuStreams, CurrentStreamIsPerThreadAndPerDevice) {
  const auto side = newSideStream(1);
  const c10::StreamGuard guard(side);
  EXPECT_EQ(guardImpl().getStream(emuDevice(1)), side);
  EXPECT_EQ(guardImpl().getStream(emuDevice(0)), defaultStream(0));
  c10::Stream seen = side;
  std::thread([&] { seen = guardImpl().getStream(emuDevice(1)); }).join();
  EXPECT_EQ(seen, defaultStream(1));
  const auto pooled = guardImpl().getStreamFromGlobalPool(emuDevice(0), false);
  EXPECT_NE(pooled.id(), 0);
}

TEST_F(EmuEvents, QuerySynchronizeAndElapsedTimeFollowTheStream) {
  setStreamDelay(std::chrono::milliseconds(100));
  const auto side = newSideStream(0);
  c10::Event start(c10::DeviceType::PrivateUse1, c10::EventFlag::BACKEND_DEFAULT);
  c10::Event end(c10::DeviceType::PrivateUse1, c10::EventFlag::BACKEND_DEFAULT);
  EXPECT_TRUE(start.query());  // never recorded
  start.record(side);
  auto batch = prefetch(pinnedRamp(), side);
  end.record(side);
  EXPECT_FALSE(end.query());  // 3 tasks of 100 ms each are still queued
  EXPECT_FALSE(side.query());
  end.synchronize();
  EXPECT_TRUE(end.query());
  EXPECT_GE(start.elapsedTime(end), 150.0);  // the copy and the end marker each waited 100 ms
  // The host synchronised the end event: the batch may now be read without a wait.
  EXPECT_TRUE(torch::equal(batch.cpu(), torch::arange(kN, torch::kFloat)));
  c10::Event onDefault(c10::DeviceType::PrivateUse1);
  onDefault.record(defaultStream(0));
  EXPECT_TRUE(onDefault.query());  // the default stream runs on the host
}

TEST_F(EmuEvents, SideStreamWaitingOnAnotherSideStreamRunsAfterIt) {
  setStreamDelay(std::chrono::milliseconds(30));
  const auto producer = newSideStream(0);
  const auto consumer = newSideStream(0);
  const auto host = pinnedRamp();
  auto batch = prefetch(host, producer);
  c10::Event ready(c10::DeviceType::PrivateUse1);
  ready.record(producer);
  ready.block(consumer);
  auto out = torch::empty({kN}, torch::TensorOptions().pinned_memory(true));
  {
    const c10::StreamGuard guard(consumer);
    out.copy_(batch, /*non_blocking=*/true);
  }
  consumer.synchronize();
  EXPECT_TRUE(torch::equal(out, host));
  batch.record_stream(consumer);
}

}  // namespace
}  // namespace testing
}  // namespace emu
}  // namespace hddp
