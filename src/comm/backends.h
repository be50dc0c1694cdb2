// Creation of LibTorch's c10d backends. Each lives in its own file and is compiled or
// not (nccl_backend.cpp vs nccl_unavailable.cpp); the communicator is backend-agnostic.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "hddp/comm/communicator.h"

namespace hddp {
namespace detail {

c10::intrusive_ptr<c10d::Backend> createGlooBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    const CommunicatorOptions& options);

c10::intrusive_ptr<c10d::Backend> createNcclBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    const CommunicatorOptions& options);

}  // namespace detail
}  // namespace hddp
