// Built instead of cuda_properties.cpp without CUDA: no CUDA devices.
#include "hddp/core/error.h"
#include "topology/cuda_properties.h"

namespace hddp {
namespace detail {

int cudaDeviceCount() { return 0; }

DeviceInfo cudaDeviceInfo(int index) {
  HDDP_THROW(Error, "CUDA device ", index, " requested, but this hddp was built without CUDA");
}

}  // namespace detail
}  // namespace hddp
