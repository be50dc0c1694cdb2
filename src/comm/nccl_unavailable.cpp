// Built instead of nccl_backend.cpp when hddp is compiled without CUDA.
#include "comm/backends.h"
#include "hddp/core/error.h"

namespace hddp {

bool ncclAvailable() noexcept { return false; }

std::string ncclVersion() { return "not built"; }

namespace detail {

c10::intrusive_ptr<c10d::Backend> createNcclBackend(const c10::intrusive_ptr<c10d::Store>&, int,
                                                    int, std::chrono::milliseconds,
                                                    const CommunicatorOptions&) {
  HDDP_THROW(ConfigError,
             "this hddp was built without CUDA, so it has no NCCL backend; "
             "rebuild against a CUDA build of LibTorch (HDDP_WITH_CUDA=AUTO) or use "
             "Backend::Gloo");
}

}  // namespace detail
}  // namespace hddp
