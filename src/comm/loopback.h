// Loopback addresses and a listening socket bound to loopback only: a single-node job
// must not listen on the machine's other interfaces.
#pragma once

#include <cstdint>
#include <string>

namespace hddp {
namespace detail {

/// "localhost", 127.x.y.z, ::1 (with or without brackets).
bool isLoopbackAddress(const std::string& host);

/// A TCP socket bound to 127.0.0.1:`port` (0 = a free port) and listening. Throws
/// hddp::DistributedError naming the port when the port is taken. The caller owns it.
int listenOnLoopback(uint16_t port);

}  // namespace detail
}  // namespace hddp
