// NCCL through LibTorch's own c10d::ProcessGroupNCCL (the NCCL that LibTorch loads).
// Compiled only when the Torch found has CUDA.
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "comm/backends.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {

bool ncclAvailable() noexcept { return true; }

std::string ncclVersion() {
  try {
    return c10d::getNcclVersion();
  } catch (const std::exception& e) {
    return std::string("unknown (") + e.what() + ")";
  }
}

namespace detail {

c10::intrusive_ptr<c10d::Backend> createNcclBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    const CommunicatorOptions& options) {
  HDDP_CHECK_AS(ConfigError, options.device.is_cuda(), "the NCCL backend needs a CUDA device, got ",
                options.device, "; use Backend::Gloo for CPU tensors");
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
  pg->setBoundDeviceId(options.device);
  HDDP_LOG_DEBUG("comm", "created NCCL communicator: rank ", rank, "/", size, " on ",
                 options.device);
  return pg;
}

}  // namespace detail
}  // namespace hddp
