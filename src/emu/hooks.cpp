// PrivateUse1 hooks: what ATen asks of a device type outside operators (pinned memory,
// generators, the device of a pointer, the current device).

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cstring>

#include "emu/allocator.h"
#include "emu/guard.h"
#include "emu/runtime.h"

namespace hddp {
namespace emu {
namespace detail {
namespace {

class EmuHooks final : public at::PrivateUse1HooksInterface {
 public:
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return installedDeviceCount() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex /*device*/) const override { return true; }
  void init() const override {}

  // emu draws random numbers from the CPU generator: the fallback runs random operators on
  // the CPU, and a seeded run on emu then equals the same run on the CPU.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex /*device*/) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex /*device*/) const override {
    return at::detail::createCPUGenerator();
  }

  at::Device getDeviceFromPtr(void* data) const override { return deviceOfPointer(data); }
  bool isPinnedPtr(const void* data) const override { return isPinned(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return pinnedAllocator(); }

  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(installedDeviceCount());
  }
  void setCurrentDevice(c10::DeviceIndex device) const override {
    c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)
        ->setDevice({c10::DeviceType::PrivateUse1, device});
  }
  c10::DeviceIndex getCurrentDevice() const override { return currentDeviceIndex(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    const c10::DeviceIndex old = currentDeviceIndex();
    setCurrentDevice(device);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }

  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t bytes) const override {
    TORCH_CHECK(storage.resizable(), "hddp::emu: this storage is not resizable");
    const c10::DeviceGuard guard(storage.device());
    c10::DataPtr fresh = deviceAllocator()->allocate(bytes);
    const size_t keep = std::min(bytes, storage.nbytes());
    if (keep > 0 && storage.data() != nullptr) {
      std::memcpy(fresh.get(), storage.data(), keep);
    }
    storage.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(fresh));
    storage.unsafeGetStorageImpl()->set_nbytes(bytes);
  }
};

}  // namespace

void registerHooks() {
  static auto* hooks = new EmuHooks;  // leaked: ATen keeps the pointer for the process
  at::RegisterPrivateUse1HooksInterface(hooks);
}

}  // namespace detail
}  // namespace emu
}  // namespace hddp
