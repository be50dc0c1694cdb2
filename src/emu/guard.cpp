// The device guard: devices, streams and events of emu, as LibTorch sees them through
// c10::impl::DeviceGuardImplInterface (c10::Device, c10::Stream, c10::Event).

#include "emu/guard.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <array>
#include <memory>

#include "emu/allocator.h"
#include "emu/ordering.h"
#include "emu/runtime.h"
#include "emu/streams.h"

namespace hddp {
namespace emu {
namespace detail {
namespace {

constexpr auto kEmu = c10::DeviceType::PrivateUse1;

thread_local c10::DeviceIndex tlsDevice = 0;
thread_local std::array<c10::StreamId, kMaxDevices> tlsStreams{};

// What a c10::Event's void* points to.
struct EventRecord {
  c10::Stream stream{c10::Stream::DEFAULT, c10::Device(kEmu, 0)};
  std::shared_ptr<Marker> marker;  // null until recorded
  Clock clock;
};

c10::Stream makeStream(c10::DeviceIndex device, c10::StreamId id) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kEmu, device), id);
}

class EmuGuardImpl final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override { return kEmu; }

  c10::Device exchangeDevice(c10::Device d) const override {
    const c10::Device old = getDevice();
    setDevice(d);
    return old;
  }

  c10::Device getDevice() const override { return {kEmu, tlsDevice}; }

  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kEmu, "hddp::emu: expected an emu device, got ", d);
    if (d.has_index()) {
      checkDeviceIndex(d.index());
      tlsDevice = d.index();
    }
  }

  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index()) {
      tlsDevice = d.index();
    }
  }

  c10::Stream getStream(c10::Device d) const override { return currentStreamOf(indexOf(d)); }

  c10::Stream getDefaultStream(c10::Device d) const override { return makeStream(indexOf(d), 0); }

  c10::Stream getStreamFromGlobalPool(c10::Device d, bool /*isHighPriority*/) const override {
    static std::atomic<uint32_t> next{0};
    return makeStream(indexOf(d), 1 + static_cast<c10::StreamId>(next.fetch_add(1) % kPoolSize));
  }

  c10::Stream getNewStream(c10::Device d, int /*priority*/) const override {
    return makeStream(indexOf(d), newStreamId());
  }

  c10::Stream exchangeStream(c10::Stream s) const override {
    const c10::DeviceIndex device = indexOf(s.device());
    const c10::Stream old = currentStreamOf(device);
    tlsStreams[device] = s.id();
    return old;
  }

  void destroyEvent(void* event, const c10::DeviceIndex /*device*/) const noexcept override {
    delete static_cast<EventRecord*>(event);
  }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device,
              const c10::EventFlag /*flag*/) const override {
    TORCH_CHECK(device == -1 || device == stream.device_index(),
                "hddp::emu: an event of emu:", static_cast<int>(device), " cannot be recorded on ",
                describeStream(stream));
    auto* e = static_cast<EventRecord*>(*event);
    if (e == nullptr) {
      e = new EventRecord;
      *event = e;
    }
    e->stream = stream;
    e->clock = snapshot(stream);
    e->marker = std::make_shared<Marker>();
    if (stream.id() == 0) {
      completeMarker(*e->marker);
    } else {
      worker(stream).enqueue([m = e->marker] { completeMarker(*m); });
    }
  }

  void block(void* event, const c10::Stream& stream) const override {
    const auto* e = static_cast<const EventRecord*>(event);
    if (e == nullptr || !e->marker) {
      return;  // never recorded: nothing to wait for, as on CUDA
    }
    streamWaits(stream, e->clock);
    if (stream.id() == 0) {
      waitMarker(*e->marker);  // the default stream runs on the host
    } else {
      worker(stream).enqueue([m = e->marker] { waitMarker(*m); });
    }
  }

  bool queryEvent(void* event) const override {
    const auto* e = static_cast<const EventRecord*>(event);
    if (e == nullptr || !e->marker) {
      return true;
    }
    if (!e->marker->done.load()) {
      return false;
    }
    hostWaits(e->clock);
    return true;
  }

  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(installedDeviceCount());
  }

  bool queryStream(const c10::Stream& stream) const override {
    if (stream.id() != 0 && !worker(stream).idle()) {
      return false;
    }
    hostSyncStream(stream);
    return true;
  }

  void synchronizeStream(const c10::Stream& stream) const override {
    synchronizeStreamOnHost(stream);
  }

  void synchronizeEvent(void* event) const override {
    const auto* e = static_cast<const EventRecord*>(event);
    if (e == nullptr || !e->marker) {
      return;
    }
    waitMarker(*e->marker);
    hostWaits(e->clock);
  }

  void synchronizeDevice(const c10::DeviceIndex device) const override {
    checkDeviceIndex(device);
    drainDevice(device);
    hostSyncDevice(device);
  }

  void recordDataPtrOnStream(const c10::DataPtr& data, const c10::Stream& stream) const override {
    recordStream(data.get(), stream);
  }

  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device*/) const override {
    const auto* a = static_cast<const EventRecord*>(start);
    const auto* b = static_cast<const EventRecord*>(end);
    TORCH_CHECK(a != nullptr && b != nullptr && a->marker && b->marker,
                "hddp::emu: elapsedTime needs two recorded events");
    TORCH_CHECK(a->marker->done.load() && b->marker->done.load(),
                "hddp::emu: elapsedTime needs both events completed: synchronize the end "
                "event (c10::Event::synchronize) first");
    return std::chrono::duration<double, std::milli>(b->marker->when - a->marker->when).count();
  }

 private:
  static c10::DeviceIndex indexOf(c10::Device d) {
    const c10::DeviceIndex index = d.has_index() ? d.index() : tlsDevice;
    checkDeviceIndex(index);
    return index;
  }
};

}  // namespace

c10::DeviceIndex currentDeviceIndex() noexcept { return tlsDevice; }

c10::Stream currentStreamOf(c10::DeviceIndex device) noexcept {
  const c10::StreamId id = (device >= 0 && device < kMaxDevices) ? tlsStreams[device] : 0;
  return makeStream(device, id);
}

void synchronizeStreamOnHost(c10::Stream stream) {
  if (stream.id() != 0) {
    worker(stream).drain();
  }
  hostSyncStream(stream);
}

void registerGuard() {
  static c10::impl::DeviceGuardImplRegistrar registrar(kEmu, new EmuGuardImpl);
}

}  // namespace detail
}  // namespace emu
}  // namespace hddp
