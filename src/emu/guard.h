#pragma once

// Private to hddp::emu: the calling thread's current device and current streams.

#include <c10/core/Stream.h>

namespace hddp {
namespace emu {
namespace detail {

c10::DeviceIndex currentDeviceIndex() noexcept;
/// The calling thread's current stream on `device` (the default stream unless changed).
c10::Stream currentStreamOf(c10::DeviceIndex device) noexcept;

/// Host-side stream operations shared by the guard and the kernels.
void synchronizeStreamOnHost(c10::Stream stream);

}  // namespace detail
}  // namespace emu
}  // namespace hddp
