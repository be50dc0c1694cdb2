#include "hddp/core/autocast.h"

#include "core/torch_compat.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {
namespace {

c10::DeviceType checkedDevice(c10::DeviceType device) {
  HDDP_CHECK(compat::autocastAvailable(device), "AutocastGuard: LibTorch has no autocast for ",
             c10::DeviceTypeName(device),
             " devices (it has for CPU, CUDA and other accelerators "
             "it knows, e.g. a PrivateUse1 backend)");
  return device;
}

}  // namespace

c10::ScalarType AutocastGuard::defaultDtype(c10::DeviceType device) {
  // GPUs train in float16 (with a GradScaler) by default, as PyTorch; CPUs in bfloat16.
  return device == c10::kCPU ? c10::kBFloat16 : c10::kHalf;
}

AutocastGuard::AutocastGuard(c10::DeviceType device, std::optional<c10::ScalarType> dtype,
                             bool enabled)
    : device_(checkedDevice(device)),
      previousEnabled_(compat::autocastEnabled(device)),
      previousDtype_(compat::autocastDtype(device)) {
  const c10::ScalarType target = dtype.value_or(defaultDtype(device));
  HDDP_CHECK(target == c10::kBFloat16 || target == c10::kHalf,
             "AutocastGuard: autocast dtype must be bfloat16 or float16, got ", target);
  if (device == c10::kCPU && target == c10::kHalf) {
    HDDP_LOG_WARN("core", "autocast float16 on CPU is slow on most processors; prefer bfloat16");
  }
  compat::setAutocastDtype(device, target);
  compat::setAutocastEnabled(device, enabled);
  compat::incrementAutocastNesting();
}

AutocastGuard::~AutocastGuard() {
  try {
    if (compat::decrementAutocastNesting() == 0) {
      compat::clearAutocastCache();
    }
    compat::setAutocastEnabled(device_, previousEnabled_);
    compat::setAutocastDtype(device_, previousDtype_);
  } catch (const std::exception& e) {
    HDDP_LOG_ERROR("core", "restoring autocast state failed: ", e.what());
  }
}

}  // namespace hddp
