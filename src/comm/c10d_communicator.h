// The Communicator over a LibTorch c10d backend (ProcessGroupGloo, ProcessGroupNCCL):
// argument checks, Avg on Gloo, staging other devices' tensors through the host, and the
// Work each collective returns. makeCommunicator (communicator.cpp) creates the backend
// and wraps it here. Internal to the comm layer.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <memory>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "hddp/comm/communicator.h"

namespace hddp {
namespace detail {

/// Rank `rank` of `size` over `backend` (of kind `kind`), with `timeout` for collectives
/// that give none and `device` for NCCL. The communicator owns the backend and shuts an
/// NCCL one down when it is destroyed.
std::unique_ptr<Communicator> makeC10dCommunicator(c10::intrusive_ptr<c10d::Backend> backend,
                                                   Backend kind, int rank, int size,
                                                   std::chrono::milliseconds timeout,
                                                   c10::Device device);

}  // namespace detail
}  // namespace hddp
