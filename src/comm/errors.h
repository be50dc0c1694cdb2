// Maps exceptions from c10d (stores, Gloo, NCCL) to hddp's typed errors, adding what
// the caller was doing. Call only inside a catch block.
#pragma once

#include <string>

namespace hddp {
namespace detail {

/// Rethrows the exception being handled as hddp::TimeoutError, StoreError or
/// BackendError, its message prefixed with `context`. hddp errors pass through
/// unchanged.
[[noreturn]] void rethrowAsDistributed(const std::string& context, bool storeOperation);

}  // namespace detail
}  // namespace hddp
