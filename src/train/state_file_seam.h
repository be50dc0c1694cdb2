// A test seam in the state file's write path (not public API): a test installs a hook
// that runs after the header is written and before the payload, e.g. to write half of
// the payload and exit as a crash would. Nothing in the library installs one.
#pragma once

#include <string>

namespace hddp {
namespace detail {

/// Called with the open temporary file, its path and the payload about to be written.
using StateWriteHook = void (*)(int fd, const std::string& tmpPath, const std::string& payload);
/// Installs `hook` for every following writeStateFile() in this process; nullptr removes it.
void setStateWriteHook(StateWriteHook hook) noexcept;

}  // namespace detail
}  // namespace hddp
