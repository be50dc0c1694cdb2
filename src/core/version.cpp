#include "hddp/version.h"

namespace hddp {

const char* version() noexcept { return HDDP_VERSION_STRING; }

bool builtWithCuda() noexcept {
#ifdef HDDP_BUILT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace hddp
