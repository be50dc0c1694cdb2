// RAII autocast (automatic mixed precision) for one device type.
//
//   {
//     hddp::AutocastGuard amp(c10::kCPU);            // bf16 on CPU
//     auto y = linear(x);                            // y is bf16
//   }                                                // previous state restored
//
// Defaults follow PyTorch: bf16 on CPU, fp16 on CUDA. Nested guards restore the
// enclosing state; the autocast weight cache is cleared when the outermost guard ends,
// as torch.autocast's __exit__ does. Not copyable or movable; thread-local state, so
// construct and destroy on one thread.
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <optional>

namespace hddp {

class AutocastGuard {
 public:
  /// `dtype` default: kBFloat16 on CPU, kHalf on CUDA. `enabled = false` turns autocast
  /// off inside the scope (e.g. for a numerically sensitive loss).
  explicit AutocastGuard(c10::DeviceType device, std::optional<c10::ScalarType> dtype = {},
                         bool enabled = true);
  ~AutocastGuard();

  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

  /// The dtype autocast uses by default for `device` (bf16 CPU, fp16 CUDA).
  static c10::ScalarType defaultDtype(c10::DeviceType device);

 private:
  c10::DeviceType device_;
  bool previousEnabled_;
  c10::ScalarType previousDtype_;
};

}  // namespace hddp
