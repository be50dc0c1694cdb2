#include "emu/allocator.h"

#include <c10/util/Backtrace.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

#include "emu/guard.h"
#include "emu/ordering.h"
#include "emu/runtime.h"
#include "hddp/emu/emu.h"

namespace hddp {
namespace emu {
namespace detail {
namespace {

namespace cda = c10::CachingDeviceAllocator;
constexpr size_t kAggregate = static_cast<size_t>(cda::StatType::AGGREGATE);
constexpr size_t kSmallPool = static_cast<size_t>(cda::StatType::SMALL_POOL);
constexpr size_t kLargePool = static_cast<size_t>(cda::StatType::LARGE_POOL);
// Blocks up to 1 MiB count as the small pool, as in CUDA's caching allocator.
constexpr size_t kSmallBlock = size_t{1} << 20;

std::string formatBytes(int64_t bytes) {
  std::ostringstream out;
  out.precision(2);
  out << std::fixed;
  if (bytes >= (int64_t{1} << 30)) {
    out << static_cast<double>(bytes) / static_cast<double>(int64_t{1} << 30) << " GiB";
  } else if (bytes >= (int64_t{1} << 20)) {
    out << static_cast<double>(bytes) / static_cast<double>(int64_t{1} << 20) << " MiB";
  } else {
    out << bytes << " bytes";
  }
  return out.str();
}

std::atomic<int>& ownDeviceIndex() {
  static std::atomic<int> own{-1};
  return own;
}

// Devices whose stray allocation was reported (once each, until cleared).
std::array<std::atomic<bool>, kMaxDevices>& strayReported() {
  static std::array<std::atomic<bool>, kMaxDevices> reported{};
  return reported;
}

// An allocation on `device` by a process that computes on another emu device only: stored
// as a violation, with the backtrace of the first such allocation per device.
void checkOwnDevice(c10::DeviceIndex device, size_t bytes) {
  const int own = ownDeviceIndex().load();
  if (own < 0 || device == own) {
    return;
  }
  if (strayReported().at(static_cast<size_t>(device)).exchange(true)) {
    return;
  }
  std::ostringstream out;
  out << "hddp::emu: this process computes on emu:" << own
      << " (hddp::emu::setOwnDevice) but allocated " << bytes
      << " bytes on emu:" << static_cast<int>(device)
      << ", the allocating thread's current device: make the rank's device current "
         "(c10::DeviceGuard, or once per thread as torch.cuda.set_device does) or give the "
         "tensor a device with an index. Allocated at:\n"
      << c10::get_backtrace(/*frames_to_skip=*/1, /*maximum_number_of_frames=*/32);
  addViolation(out.str());
}

void addStat(cda::Stat& stat, int64_t amount) {
  stat.current += amount;
  stat.peak = std::max(stat.peak, stat.current);
  if (amount > 0) {
    stat.allocated += amount;
  } else {
    stat.freed -= amount;
  }
}

struct Allocation {
  size_t bytes;
  c10::DeviceIndex device;
};

// Device memory: every allocation is its own malloc (nothing is cached, so reserved bytes
// always equal allocated bytes and emptyCache() has nothing to release).
class DeviceMemory final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const c10::DeviceIndex device = currentDeviceIndex();
    checkDeviceIndex(device);
    checkOwnDevice(device, n);
    const c10::Device where(c10::DeviceType::PrivateUse1, device);
    if (n == 0) {
      return {nullptr, nullptr, &deleteBlock, where};
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& stats = stats_.at(device);
      const int64_t used = stats.allocated_bytes[kAggregate].current;
      const int64_t total = totals_.at(device);
      if (used + static_cast<int64_t>(n) > total) {
        ++stats.num_ooms;
        TORCH_CHECK_WITH(OutOfMemoryError, false, "emu:", static_cast<int>(device),
                         " out of memory: tried to allocate ", formatBytes(static_cast<int64_t>(n)),
                         "; ", formatBytes(used), " of ", formatBytes(total),
                         " in use. Free tensors, use a smaller batch, or raise the total "
                         "(HDDP_EMU_MEMORY_GIB, hddp::emu::setMemoryTotal).");
      }
      count(stats, static_cast<int64_t>(n), +1);
    }
    void* data = std::malloc(n);
    if (data == nullptr) {
      std::lock_guard<std::mutex> lock(mutex_);
      count(stats_.at(device), static_cast<int64_t>(n), -1);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "emu:", static_cast<int>(device),
                       " out of memory: the host could not provide ", formatBytes(n));
    }
    std::memset(data, kPoisonByte, n);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live_[data] = Allocation{n, device};
    }
    onAllocate(data, n, currentStreamOf(device));
    return {data, data, &deleteBlock, where};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &deleteBlock; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t /*pool*/) override {}

  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    detail::recordStream(ptr.get(), stream);
  }

  cda::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    checkDeviceIndex(device);
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_.at(device);
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    checkDeviceIndex(device);
    std::lock_guard<std::mutex> lock(mutex_);
    auto& s = stats_.at(device);
    for (auto* array : {&s.allocation, &s.segment, &s.active, &s.allocated_bytes, &s.reserved_bytes,
                        &s.active_bytes, &s.requested_bytes}) {
      for (auto& stat : *array) {
        stat.allocated = 0;
        stat.freed = 0;
      }
    }
    s.num_ooms = 0;
    s.num_device_alloc = 0;
    s.num_device_free = 0;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    checkDeviceIndex(device);
    std::lock_guard<std::mutex> lock(mutex_);
    auto& s = stats_.at(device);
    for (auto* array : {&s.allocation, &s.segment, &s.active, &s.allocated_bytes, &s.reserved_bytes,
                        &s.active_bytes, &s.requested_bytes}) {
      for (auto& stat : *array) {
        stat.peak = stat.current;
      }
    }
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    checkDeviceIndex(device);
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t total = totals_.at(device);
    const int64_t used = stats_.at(device).reserved_bytes[kAggregate].current;
    return {static_cast<size_t>(std::max<int64_t>(0, total - used)), static_cast<size_t>(total)};
  }

  void configure(int devices, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int i = 0; i < devices; ++i) {
      totals_.at(i) = bytes;
    }
  }

  void setTotal(int device, int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    totals_.at(device) = bytes;
  }

  int64_t total(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    return totals_.at(device);
  }

  c10::Device deviceOf(const void* data) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.upper_bound(data);
    if (it != live_.begin()) {
      --it;
      const auto* begin = static_cast<const char*>(it->first);
      if (static_cast<const char*>(data) < begin + it->second.bytes) {
        return {c10::DeviceType::PrivateUse1, it->second.device};
      }
    }
    TORCH_CHECK(false, "hddp::emu: ", data, " is not emu device memory");
  }

  void release(void* data) noexcept {
    onFree(data);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = live_.find(data);
      if (it != live_.end()) {
        count(stats_.at(it->second.device), static_cast<int64_t>(it->second.bytes), -1);
        live_.erase(it);
      }
    }
    std::free(data);
  }

 private:
  static void deleteBlock(void* data);

  static void count(cda::DeviceStats& s, int64_t bytes, int sign) {
    const size_t pool = static_cast<size_t>(bytes) <= kSmallBlock ? kSmallPool : kLargePool;
    for (size_t type : {kAggregate, pool}) {
      addStat(s.allocation[type], sign);
      addStat(s.segment[type], sign);
      addStat(s.active[type], sign);
      addStat(s.allocated_bytes[type], sign * bytes);
      addStat(s.reserved_bytes[type], sign * bytes);
      addStat(s.active_bytes[type], sign * bytes);
      addStat(s.requested_bytes[type], sign * bytes);
    }
    if (sign > 0) {
      ++s.num_device_alloc;
    } else {
      ++s.num_device_free;
    }
  }

  std::mutex mutex_;
  std::array<cda::DeviceStats, kMaxDevices> stats_{};
  std::array<int64_t, kMaxDevices> totals_{};
  std::map<const void*, Allocation> live_;
};

DeviceMemory& deviceMemory() {
  static auto* memory = new DeviceMemory;  // leaked: deleters may run during exit
  return *memory;
}

void DeviceMemory::deleteBlock(void* data) {
  if (data != nullptr) {
    deviceMemory().release(data);
  }
}

// Pinned host memory: plain host memory, remembered so that is_pinned() answers true.
class PinnedMemory final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) {
      return {nullptr, nullptr, &deleteBlock, cpu};
    }
    void* data = std::malloc(n);
    TORCH_CHECK_WITH(OutOfMemoryError, data != nullptr, "hddp::emu: could not allocate ", n,
                     " bytes of pinned memory");
    std::memset(data, kPoisonByte, n);
    std::lock_guard<std::mutex> lock(mutex_);
    live_[data] = n;
    return {data, data, &deleteBlock, cpu};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &deleteBlock; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  bool contains(const void* data) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.upper_bound(data);
    if (it == live_.begin()) {
      return false;
    }
    --it;
    return static_cast<const char*>(data) < static_cast<const char*>(it->first) + it->second;
  }

  void release(void* data) noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live_.erase(data);
    }
    std::free(data);
  }

 private:
  static void deleteBlock(void* data);

  std::mutex mutex_;
  std::map<const void*, size_t> live_;
};

PinnedMemory& pinnedMemory() {
  static auto* memory = new PinnedMemory;  // leaked: deleters may run during exit
  return *memory;
}

void PinnedMemory::deleteBlock(void* data) {
  if (data != nullptr) {
    pinnedMemory().release(data);
  }
}

}  // namespace

c10::DeviceAllocator* deviceAllocator() { return &deviceMemory(); }
c10::Allocator* pinnedAllocator() { return &pinnedMemory(); }

void configureMemory(int deviceCount, int64_t bytes) {
  deviceMemory().configure(deviceCount, bytes);
}

void setDeviceMemoryTotal(int device, int64_t bytes) {
  checkDeviceIndex(static_cast<c10::DeviceIndex>(device));
  TORCH_CHECK(bytes > 0, "hddp::emu::setMemoryTotal: the total of emu:", device,
              " must be > 0 bytes, got ", bytes);
  deviceMemory().setTotal(device, bytes);
}

int64_t deviceMemoryTotal(int device) {
  checkDeviceIndex(static_cast<c10::DeviceIndex>(device));
  return deviceMemory().total(device);
}

bool isPinned(const void* data) { return data != nullptr && pinnedMemory().contains(data); }

c10::Device deviceOfPointer(const void* data) { return deviceMemory().deviceOf(data); }

void resetStrayReports() noexcept {
  for (auto& r : strayReported()) {
    r.store(false);
  }
}

}  // namespace detail

void setOwnDevice(int device) {
  if (device != -1) {
    detail::checkDeviceIndex(static_cast<c10::DeviceIndex>(device));
  }
  detail::ownDeviceIndex().store(device);
  detail::resetStrayReports();
}

int ownDevice() { return detail::ownDeviceIndex().load(); }
}  // namespace emu
}  // namespace hddp
