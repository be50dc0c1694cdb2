// Errors hddp throws, and the macros that throw them.
//
// Every hddp exception derives from hddp::Error, which derives from c10::Error, so a
// LibTorch user needs one `catch (const c10::Error&)` (or std::exception). Messages
// carry file:line, the offending values, and what to do about them.
//
//   HDDP_CHECK(cond, "...", values...)          misuse / bad input      -> hddp::Error
//   HDDP_CHECK_AS(Type, cond, "...", values...) same, with a typed error -> Type
//   HDDP_INTERNAL_ASSERT(cond, "...")           a bug in hddp itself     -> hddp::InternalError
//   HDDP_THROW(Type, "...", values...)          unconditional
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace hddp {

/// Base of every exception hddp throws. Catchable as c10::Error and std::exception.
class Error : public c10::Error {
 public:
  using c10::Error::Error;
};

/// Bad configuration: an environment variable or option that cannot be used.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A bug in hddp itself (an internal invariant broke). Please report it.
class InternalError : public Error {
 public:
  using Error::Error;
};

/// Family of errors from distributed operation (rendezvous, collectives).
class DistributedError : public Error {
 public:
  using Error::Error;
};

/// The rendezvous store failed (cannot connect, key missing, server gone).
class StoreError : public DistributedError {
 public:
  using DistributedError::DistributedError;
};

/// An operation did not complete within its timeout (a peer never arrived or hangs).
class TimeoutError : public DistributedError {
 public:
  using DistributedError::DistributedError;
};

/// The communication backend (Gloo, NCCL) reported an error, e.g. a peer died.
class BackendError : public DistributedError {
 public:
  using DistributedError::DistributedError;
};

/// A dataset could not be read or a sample could not be loaded (names the file or the
/// sample index).
class DataError : public Error {
 public:
  using Error::Error;
};

/// A training state file is missing, truncated, corrupt or does not match the job.
class StateError : public Error {
 public:
  using Error::Error;
};

namespace detail {
/// "src/comm/store.cpp" -> "store.cpp", for messages.
constexpr const char* baseName(const char* path) {
  const char* base = path;
  for (const char* p = path; *p; ++p) {
    if (*p == '/') {
      base = p + 1;
    }
  }
  return base;
}
}  // namespace detail

}  // namespace hddp

#define HDDP_THROW(ErrorType, ...)                                                                 \
  throw ErrorType(::c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},      \
                  ::c10::str("hddp: ", __VA_ARGS__, " [", ::hddp::detail::baseName(__FILE__), ":", \
                             __LINE__, "]"))

#define HDDP_CHECK_AS(ErrorType, cond, ...) \
  do {                                      \
    if (C10_UNLIKELY_OR_CONST(!(cond))) {   \
      HDDP_THROW(ErrorType, __VA_ARGS__);   \
    }                                       \
  } while (false)

#define HDDP_CHECK(cond, ...) HDDP_CHECK_AS(::hddp::Error, cond, __VA_ARGS__)

#define HDDP_INTERNAL_ASSERT(cond, ...)                                     \
  HDDP_CHECK_AS(::hddp::InternalError, cond, "internal assertion `", #cond, \
                "` failed: ", ::c10::str(__VA_ARGS__),                      \
                ". This is a bug in hddp; please report it with this message.")
