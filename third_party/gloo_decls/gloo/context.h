// See third_party/gloo_decls/README.md: declarations only.
#pragma once

#include <chrono>

namespace gloo {

// Only the member that ProcessGroupGloo.hpp's inline setTimeout() names. hddp never
// creates, copies or takes the size of a Context; LibTorch owns them.
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};

}  // namespace gloo
