#pragma once

// Private to hddp::emu: device memory (c10::DeviceAllocator with statistics, a total per
// device and an out-of-memory error) and pinned host memory. Both are host memory that
// starts as 0xFF bytes, so reads of memory nothing wrote give NaN.

#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <cstdint>

namespace hddp {
namespace emu {
namespace detail {

/// Fresh device and pinned memory holds this byte.
constexpr unsigned char kPoisonByte = 0xFF;

c10::DeviceAllocator* deviceAllocator();
c10::Allocator* pinnedAllocator();

/// Sizes the per-device tables; the totals of devices not set yet become `bytes`.
void configureMemory(int deviceCount, int64_t bytes);
void setDeviceMemoryTotal(int device, int64_t bytes);
int64_t deviceMemoryTotal(int device);

/// Whether `data` lies in a pinned block.
bool isPinned(const void* data);
/// The emu device whose memory holds `data`; throws c10::Error when none does.
c10::Device deviceOfPointer(const void* data);
/// Forgets which devices had a stray allocation reported (setOwnDevice, clearViolations).
void resetStrayReports() noexcept;

}  // namespace detail
}  // namespace emu
}  // namespace hddp
