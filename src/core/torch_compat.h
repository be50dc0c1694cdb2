// The one place where LibTorch version differences are absorbed. Code elsewhere calls
// these functions and never tests TORCH_VERSION itself.
#pragma once

#include <ATen/autocast_mode.h>
#include <torch/version.h>

namespace hddp {
namespace compat {

// Autocast state per device type. LibTorch 2.x has the device-generic API; 1.13 had
// per-device functions (set_enabled / set_cpu_enabled, get_autocast_gpu_dtype, ...).
#if TORCH_VERSION_MAJOR >= 2 && (TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 4)
inline bool autocastEnabled(c10::DeviceType d) { return at::autocast::is_autocast_enabled(d); }
inline void setAutocastEnabled(c10::DeviceType d, bool on) {
  at::autocast::set_autocast_enabled(d, on);
}
inline c10::ScalarType autocastDtype(c10::DeviceType d) {
  return at::autocast::get_autocast_dtype(d);
}
inline void setAutocastDtype(c10::DeviceType d, c10::ScalarType t) {
  at::autocast::set_autocast_dtype(d, t);
}
/// Whether LibTorch has autocast for `d`: CPU, CUDA, and the other accelerators it knows
/// (XPU, MPS, a PrivateUse1 backend such as hddp::emu, ...).
inline bool autocastAvailable(c10::DeviceType d) { return at::autocast::is_autocast_available(d); }
#else
inline bool autocastAvailable(c10::DeviceType d) { return d == c10::kCPU || d == c10::kCUDA; }
inline bool autocastEnabled(c10::DeviceType d) {
  return d == c10::kCPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
}
inline void setAutocastEnabled(c10::DeviceType d, bool on) {
  d == c10::kCPU ? at::autocast::set_cpu_enabled(on) : at::autocast::set_enabled(on);
}
inline c10::ScalarType autocastDtype(c10::DeviceType d) {
  return d == c10::kCPU ? at::autocast::get_autocast_cpu_dtype()
                        : at::autocast::get_autocast_gpu_dtype();
}
inline void setAutocastDtype(c10::DeviceType d, c10::ScalarType t) {
  d == c10::kCPU ? at::autocast::set_autocast_cpu_dtype(t)
                 : at::autocast::set_autocast_gpu_dtype(t);
}
#endif

inline int incrementAutocastNesting() { return at::autocast::increment_nesting(); }
inline int decrementAutocastNesting() { return at::autocast::decrement_nesting(); }
inline void clearAutocastCache() { at::autocast::clear_cache(); }

}  // namespace compat
}  // namespace hddp
