// hddp::emu for the *_Emu tests (label accel): the twins of the *_CUDA tests, run on an
// emulated accelerator so that the device paths run on every machine. Installed on
// first use; ctest runs each test in a process of its own, so no other test sees it.
#pragma once

#include <c10/core/Device.h>

#include "hddp/emu/emu.h"

namespace hddp {
namespace testing {

/// emu:<index> (of 2), with every emulated device at full speed, 16 GiB and no stream delay.
inline c10::Device emulatedDevice(int index = 0) {
  hddp::emu::install(hddp::emu::EmuOptions{});
  return c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(index));
}

}  // namespace testing
}  // namespace hddp
