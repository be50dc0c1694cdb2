#include "comm/loopback.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "hddp/core/error.h"

namespace hddp {
namespace detail {

bool isLoopbackAddress(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1" || host == "[::1]";
}

int listenOnLoopback(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  HDDP_CHECK_AS(DistributedError, fd >= 0, "cannot create a socket: ", std::strerror(errno));
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(fd, SOMAXCONN) != 0) {
    const int err = errno;
    close(fd);
    HDDP_THROW(
        DistributedError, "cannot listen on 127.0.0.1:", port, ": ", std::strerror(err),
        err == EADDRINUSE ? " (another job uses this port: choose another MASTER_PORT)" : "");
  }
  return fd;
}

}  // namespace detail
}  // namespace hddp
