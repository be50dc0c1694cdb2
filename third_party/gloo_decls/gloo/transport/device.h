// See third_party/gloo_decls/README.md: declarations only.
#pragma once

namespace gloo {
namespace transport {
class Device;
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo
