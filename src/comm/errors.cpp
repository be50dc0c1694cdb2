#include "comm/errors.h"

#include <algorithm>
#include <cctype>
#include <exception>

#include "hddp/core/error.h"

namespace hddp {
namespace detail {
namespace {

bool mentionsTimeout(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text.find("timed out") != std::string::npos || text.find("timeout") != std::string::npos;
}

}  // namespace

void rethrowAsDistributed(const std::string& context, FailedOperation operation) {
  std::string message;
  bool storeError = operation == FailedOperation::Store;
  try {
    throw;
  } catch (const hddp::Error&) {
    throw;
  } catch (const c10::DistStoreError& e) {
    message = e.what_without_backtrace();
    storeError = true;
  } catch (const c10::Error& e) {
    message = e.what_without_backtrace();
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "unknown exception";
  }
  if (mentionsTimeout(message)) {
    HDDP_THROW(TimeoutError, context, " timed out: ", message,
               ". A peer did not arrive or stopped responding; check that every rank is "
               "running and reachable, or raise the timeout (HDDP_TIMEOUT_SEC).");
  }
  if (storeError) {
    HDDP_THROW(StoreError, context, " failed: ", message);
  }
  HDDP_THROW(BackendError, context, " failed: ", message,
             ". If a peer process died, look at its own output for the first error.");
}

}  // namespace detail
}  // namespace hddp
