// hddp-run's group of ranks (group.h): the process helpers (a free port, what a wait
// status says) and the group's input and output (reaping the ranks, signalling them,
// pumping their output streams and the signal pipe).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "group.h"

namespace hddp {
namespace run {
namespace detail {

int freePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) {
    return 29500;
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = 29500;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

std::string describeStatus(int status) {
  if (WIFEXITED(status)) {
    return "exited with code " + std::to_string(WEXITSTATUS(status));
  }
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return "was killed by signal " + std::to_string(sig) +
           (name ? std::string(" (SIG") + name + ")" : "");
  }
  return "ended with status " + std::to_string(status);
}

int exitCodeOf(int status) {
  if (WIFEXITED(status)) {
    return WEXITSTATUS(status);
  }
  if (WIFSIGNALED(status)) {
    return 128 + WTERMSIG(status);
  }
  return 1;
}

bool Group::anyRunning() const {
  for (const auto& r : ranks_) {
    if (r.running) {
      return true;
    }
  }
  return false;
}

void Group::reap() {
  ++sweep_;
  for (auto& r : ranks_) {
    if (!r.running) {
      continue;
    }
    int status = 0;
    const pid_t done = waitpid(r.pid, &status, WNOHANG);
    if (done == r.pid) {
      r.running = false;
      r.status = status;
      r.endedInSweep = sweep_;
    }
  }
}

void Group::signalAll(int sig) {
  for (const auto& r : ranks_) {
    if (r.running) {
      kill(-r.pid, sig);  // the rank's whole process group
      kill(r.pid, sig);
    }
  }
}

void Group::drain(Stream& s) {
  char buf[65536];
  while (true) {
    const ssize_t n = read(s.fd, buf, sizeof(buf));
    if (n <= 0) {
      break;
    }
    s.emit(buf, static_cast<size_t>(n));
  }
}

void Group::pump(int timeoutMs, const std::function<void(int)>& onSig) {
  std::vector<pollfd> fds;
  std::vector<Stream*> streams;
  fds.push_back({gSignalPipe[0], POLLIN, 0});
  streams.push_back(nullptr);
  for (auto& r : ranks_) {
    for (Stream* s : {&r.out, &r.err}) {
      if (s->fd >= 0) {
        fds.push_back({s->fd, POLLIN, 0});
        streams.push_back(s);
      }
    }
  }
  if (poll(fds.data(), fds.size(), timeoutMs) <= 0) {
    return;
  }
  if (fds[0].revents & POLLIN) {
    unsigned char sigs[64];
    const ssize_t n = read(gSignalPipe[0], sigs, sizeof(sigs));
    for (ssize_t i = 0; i < n; ++i) {
      if (sigs[i] != SIGCHLD) {  // SIGCHLD only wakes the loop to reap at once
        onSig(static_cast<int>(sigs[i]));
      }
    }
  }
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents & (POLLIN | POLLHUP)) {
      char buf[65536];
      const ssize_t n = read(fds[i].fd, buf, sizeof(buf));
      if (n > 0) {
        streams[i]->emit(buf, static_cast<size_t>(n));
      } else if (n == 0 || errno == EIO) {  // EIO: a pseudo-terminal whose rank ended
        streams[i]->flush();
        close(streams[i]->fd);
        streams[i]->fd = -1;
      }
    }
  }
}
}  // namespace detail
}  // namespace run
}  // namespace hddp
