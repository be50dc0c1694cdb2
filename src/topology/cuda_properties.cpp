#include "topology/cuda_properties.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <cstdio>

namespace hddp {
namespace detail {

int cudaDeviceCount() {
  return at::detail::getCUDAHooks().hasCUDA()
             ? static_cast<int>(at::detail::getCUDAHooks().deviceCount())
             : 0;
}

DeviceInfo cudaDeviceInfo(int index) {
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(index));
  DeviceInfo info;
  info.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  info.name = p->name;
  info.memoryBytes = static_cast<int64_t>(p->totalGlobalMem);
  info.smCount = p->multiProcessorCount;
  info.computeMajor = p->major;
  info.computeMinor = p->minor;
  char bus[32];
  std::snprintf(bus, sizeof(bus), "%04x:%02x:%02x.0", p->pciDomainID, p->pciBusID, p->pciDeviceID);
  info.pciBusId = bus;
  return info;
}

}  // namespace detail
}  // namespace hddp
