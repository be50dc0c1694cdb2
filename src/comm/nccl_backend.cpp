// NCCL through LibTorch's own c10d::ProcessGroupNCCL (the NCCL that LibTorch loads).
// Compiled only when the Torch found has CUDA.
//
// A collective that cannot complete (a lost peer) is ended by c10d, not by hddp: with
// torch's defaults its watchdog ends the process within the communicator's timeout plus
// its dump wait, so torchrun's agent sees the rank fail and restarts the job. The rules
// and the settings that break them are in comm/nccl_failure_handling.h; creating a
// communicator logs which apply and warns when a lost peer would hang the rank.
#include <c10/util/env.h>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "comm/backends.h"
#include "comm/nccl_failure_handling.h"
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
  // The environment ProcessGroupNCCL reads in its constructor, read the same way.
  const NcclFailureHandling onFailure =
      ncclFailureHandling(readNcclFailureSettings([](const std::string& name) {
                            return c10::utils::get_env(name.c_str());
                          }),
                          timeout);
  if (onFailure.end == NcclFailureEnd::Nothing) {
    HDDP_LOG_WARN("comm", "NCCL communicator of rank ", rank, "/", size,
                  ": a collective that cannot complete is never ended: ", onFailure.description);
  }
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;  // the watchdog's (and blocking wait's) limit for every collective
  auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
  pg->setBoundDeviceId(options.device);
  HDDP_LOG_DEBUG("comm", "created NCCL communicator: rank ", rank, "/", size, " on ",
                 options.device, "; a collective that cannot complete: ", onFailure.description);
  return pg;
}

}  // namespace detail
}  // namespace hddp
