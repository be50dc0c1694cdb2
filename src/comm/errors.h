// Maps exceptions from c10d (stores, Gloo, NCCL) to hddp's typed errors, adding what
// the caller was doing. Call only inside a catch block.
#pragma once

#include <string>

namespace hddp {
namespace detail {

/// What failed, for the error type when it was not a timeout.
enum class FailedOperation {
  /// A collective or the backend's creation: hddp::BackendError.
  Backend,
  /// A store operation: hddp::StoreError.
  Store,
};

/// Rethrows the exception being handled as hddp::TimeoutError (any operation whose
/// error mentions a timeout), StoreError or BackendError (by `operation`; c10's store
/// errors are StoreErrors either way), its message prefixed with `context`. hddp errors
/// pass through unchanged.
[[noreturn]] void rethrowAsDistributed(const std::string& context, FailedOperation operation);

}  // namespace detail
}  // namespace hddp
