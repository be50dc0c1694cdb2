#pragma once

// Private to hddp::emu: the state every part of the backend shares (options in force,
// per-device counters, the fallback depth) and the registration entry points.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace hddp {
namespace emu {
namespace detail {

/// Most devices an emu process can have (HDDP_EMU_DEVICES is checked against it).
constexpr int kMaxDevices = 64;

/// Number of devices in force (0 before install()).
int installedDeviceCount() noexcept;
/// Throws c10::Error unless 0 <= index < installedDeviceCount().
void checkDeviceIndex(c10::DeviceIndex index);

/// Delay before each queued side-stream task, in milliseconds.
std::atomic<int64_t>& streamDelayMs();

/// Runs `work` on the calling thread as one emulated operator of `device`: measures its
/// time, adds it to the device's counters and sleeps (factor - 1) times it when the device
/// is slowed down. Nested calls (the copies inside a fallback operator) only run `work`.
void runTimed(c10::Device device, const std::function<void()>& work);

/// Runs an operator issued while `device`'s current stream may be a side stream: waits for
/// that stream's queue, then runs `work` on the calling thread inside a fallback scope (its
/// copies run at once instead of being queued), timed as one operator.
void runOnHost(c10::Device device, const std::function<void()>& work);

/// Whether the calling thread is inside an operator that runs on the host (runOnHost).
bool insideHostOperator() noexcept;

/// Throws c10::Error worded as CUDA's ("Expected all tensors to be on the same device, but
/// found at least two devices, emu:0 and cpu!"), naming `argument` of operator `op` and the
/// fix, unless `t` is undefined or lies on `device`.
void checkOnDevice(c10::Device device, const at::Tensor& t, const std::string& op,
                   const std::string& argument);

// Registration, called once by install().
void registerGuard();
void registerKernels(torch::Library& aten);
void registerFallback(torch::Library& all);
/// Autocast for emu: CUDA's op lists on AutocastPrivateUse1, a fallthrough for the rest.
void registerAutocast(torch::Library& aten, torch::Library& all);
void registerHooks();

}  // namespace detail
}  // namespace emu
}  // namespace hddp
