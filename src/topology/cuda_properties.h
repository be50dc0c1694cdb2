// CUDA device properties: cuda_properties.cpp with CUDA, cuda_properties_unavailable.cpp
// without. The rest of the topology layer is device-generic.
#pragma once

#include "hddp/topology/topology.h"

namespace hddp {
namespace detail {

int cudaDeviceCount();
/// Name, memory, SMs, capability and PCI bus id of CUDA device `index`.
DeviceInfo cudaDeviceInfo(int index);

}  // namespace detail
}  // namespace hddp
