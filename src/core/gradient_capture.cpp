#include "core/gradient_capture.h"

namespace hddp {
namespace detail {
namespace {
thread_local int gDepth = 0;
}  // namespace

GradientCaptureScope::GradientCaptureScope() { ++gDepth; }
GradientCaptureScope::~GradientCaptureScope() { --gDepth; }
bool capturingInnerGradients() noexcept { return gDepth > 0; }

}  // namespace detail
}  // namespace hddp
