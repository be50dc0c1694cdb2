#include "launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace hddp {
namespace run {
namespace {

int gSignalPipe[2] = {-1, -1};

void onSignal(int sig) {
  const unsigned char byte = static_cast<unsigned char>(sig);
  const int saved = errno;
  (void)!write(gSignalPipe[1], &byte, 1);
  errno = saved;
}

void say(const std::string& text) {
  std::string line = "hddp-run: " + text + "\n";
  (void)!write(STDERR_FILENO, line.data(), line.size());
}

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

// Collects a rank's output and writes it line by line with a prefix.
struct Stream {
  int fd = -1;
  int target = STDOUT_FILENO;
  std::string prefix;
  std::string pending;

  void emit(const char* data, size_t n) {
    pending.append(data, n);
    size_t start = 0;
    for (size_t nl; (nl = pending.find('\n', start)) != std::string::npos; start = nl + 1) {
      std::string line = prefix + pending.substr(start, nl - start + 1);
      (void)!write(target, line.data(), line.size());
    }
    pending.erase(0, start);
  }
  void flush() {
    if (!pending.empty()) {
      std::string line = prefix + pending + "\n";
      (void)!write(target, line.data(), line.size());
      pending.clear();
    }
  }
};

struct Rank {
  int globalRank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  int64_t endedInSweep = -1;  // the reap() sweep that found it ended (order of failures)
  Stream out;
  Stream err;
};

class Group {
 public:
  Group(const LaunchConfig& config, int port, int restartCount)
      : config_(config), port_(port), restartCount_(restartCount) {}

  bool start() {
    const int world = config_.nnodes * config_.nprocPerNode;
    for (int local = 0; local < config_.nprocPerNode; ++local) {
      Rank rank;
      rank.globalRank = config_.nodeRank * config_.nprocPerNode + local;
      int outPipe[2];
      int errPipe[2];
      if (pipe2(outPipe, O_CLOEXEC) != 0 || pipe2(errPipe, O_CLOEXEC) != 0) {
        say(std::string("cannot create pipes: ") + std::strerror(errno));
        return false;
      }
      std::vector<std::string> env = {
          "RANK=" + std::to_string(rank.globalRank),
          "WORLD_SIZE=" + std::to_string(world),
          "LOCAL_RANK=" + std::to_string(local),
          "LOCAL_WORLD_SIZE=" + std::to_string(config_.nprocPerNode),
          "GROUP_RANK=" + std::to_string(config_.nodeRank),
          "MASTER_ADDR=" + config_.masterAddr,
          "MASTER_PORT=" + std::to_string(port_),
          "TORCHELASTIC_RESTART_COUNT=" + std::to_string(restartCount_),
          "TORCHELASTIC_MAX_RESTARTS=" + std::to_string(config_.maxRestarts),
          "TORCHELASTIC_RUN_ID=hddp-" + std::to_string(getpid()),
      };
      if (!config_.devices.empty()) {
        std::string list;
        for (const auto& d : config_.devices) {
          list += (list.empty() ? "" : ",") + d;
        }
        env.push_back("HDDP_DEVICE=" + list);  // each rank takes entry LOCAL_RANK
      }
      if (config_.shareDevices) {
        env.push_back("HDDP_ALLOW_SHARED_DEVICE=1");
      }
      const pid_t parent = getpid();
      const pid_t pid = fork();
      if (pid < 0) {
        say(std::string("fork failed: ") + std::strerror(errno));
        return false;
      }
      if (pid == 0) {
        // Child: own process group (we forward signals ourselves), die with the launcher.
        setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) {
          _exit(127);
        }
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        signal(SIGPIPE, SIG_DFL);
        dup2(outPipe[1], STDOUT_FILENO);
        dup2(errPipe[1], STDERR_FILENO);
        for (const auto& kv : env) {
          putenv(strdup(kv.c_str()));
        }
        if (config_.nprocPerNode > 1 && !getenv("OMP_NUM_THREADS")) {
          putenv(strdup("OMP_NUM_THREADS=1"));
        }
        std::vector<char*> args;
        for (const auto& a : config_.command) {
          args.push_back(const_cast<char*>(a.c_str()));
        }
        args.push_back(nullptr);
        execvp(args[0], args.data());
        std::fprintf(stderr, "hddp-run: cannot execute '%s': %s\n", args[0], std::strerror(errno));
        _exit(127);
      }
      close(outPipe[1]);
      close(errPipe[1]);
      rank.pid = pid;
      rank.running = true;
      const std::string prefix =
          config_.noPrefix ? "" : "[rank " + std::to_string(rank.globalRank) + "] ";
      rank.out = Stream{outPipe[0], STDOUT_FILENO, prefix, {}};
      rank.err = Stream{errPipe[0], STDERR_FILENO, prefix, {}};
      ranks_.push_back(std::move(rank));
    }
    return true;
  }

  // How an attempt ended.
  struct Outcome {
    int exitCode = 0;          // 0 = every rank succeeded
    bool interrupted = false;  // a signal stopped the job (no restart then)
  };

  // Runs until all ranks ended, one failed, or a signal arrived.
  Outcome supervise() {
    bool interrupted = false;
    bool stopping = false;
    std::chrono::steady_clock::time_point killAt{};
    int result = 0;
    while (true) {
      reap();
      if (!anyRunning()) {
        break;
      }
      if (!stopping) {
        if (const Rank* first = firstFailure()) {
          say("rank " + std::to_string(first->globalRank) + " (pid " + std::to_string(first->pid) +
              ") " + describeStatus(first->status) + "; stopping the other ranks");
          for (const auto& r : ranks_) {
            if (&r != first && !r.running && r.status != 0) {
              say("rank " + std::to_string(r.globalRank) + " " + describeStatus(r.status) +
                  " at the same time");
            }
          }
          result = exitCodeOf(first->status);
          stopping = true;
        }
        if (stopping) {
          signalAll(SIGTERM);
          killAt = std::chrono::steady_clock::now() +
                   std::chrono::milliseconds(static_cast<int>(config_.graceSeconds * 1000));
        }
      } else if (std::chrono::steady_clock::now() >= killAt) {
        signalAll(SIGKILL);
        killAt = std::chrono::steady_clock::now() + std::chrono::hours(1);
      }
      pump(100, [&](int sig) {
        interrupted = true;
        if (!stopping) {
          say(std::string("received SIG") + sigabbrev_np(sig) + "; stopping all ranks");
          signalAll(sig);
          stopping = true;
          result = 128 + sig;
          killAt = std::chrono::steady_clock::now() +
                   std::chrono::milliseconds(static_cast<int>(config_.graceSeconds * 1000));
        } else {
          signalAll(SIGKILL);
        }
      });
    }
    // Drain what the ranks wrote before they ended.
    pump(0, [](int) {});
    for (auto& r : ranks_) {
      drain(r.out);
      drain(r.err);
      r.out.flush();
      r.err.flush();
      close(r.out.fd);
      close(r.err.fd);
    }
    if (result == 0) {
      if (const Rank* first = firstFailure()) {
        result = exitCodeOf(first->status);
        say("rank " + std::to_string(first->globalRank) + " " + describeStatus(first->status));
      }
    }
    return Outcome{result, interrupted};
  }

 private:
  // The rank that failed first: the earliest reap sweep (SIGCHLD wakes the launcher,
  // so a rank is normally reaped alone, before the ranks it brings down); within one
  // sweep, a rank killed by a signal before one that exited with an error (which is
  // typically a peer reporting the lost connection), then the lowest rank.
  const Rank* firstFailure() const {
    const Rank* first = nullptr;
    auto before = [](const Rank& a, const Rank& b) {
      if (a.endedInSweep != b.endedInSweep) {
        return a.endedInSweep < b.endedInSweep;
      }
      return WIFSIGNALED(a.status) && !WIFSIGNALED(b.status);
    };
    for (const auto& r : ranks_) {
      if (!r.running && r.status != 0 && (!first || before(r, *first))) {
        first = &r;
      }
    }
    return first;
  }

  bool anyRunning() const {
    for (const auto& r : ranks_) {
      if (r.running) {
        return true;
      }
    }
    return false;
  }

  void reap() {
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

  void signalAll(int sig) {
    for (const auto& r : ranks_) {
      if (r.running) {
        kill(-r.pid, sig);  // the rank's whole process group
        kill(r.pid, sig);
      }
    }
  }

  void drain(Stream& s) {
    char buf[65536];
    while (true) {
      const ssize_t n = read(s.fd, buf, sizeof(buf));
      if (n <= 0) {
        break;
      }
      s.emit(buf, static_cast<size_t>(n));
    }
  }

  template <typename OnSignal>
  void pump(int timeoutMs, OnSignal&& onSig) {
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
        } else if (n == 0) {
          streams[i]->flush();
          close(streams[i]->fd);
          streams[i]->fd = -1;
        }
      }
    }
  }

  const LaunchConfig& config_;
  int port_;
  int restartCount_;
  std::vector<Rank> ranks_;
  int64_t sweep_ = 0;
};

}  // namespace

std::string checkDevices(LaunchConfig& config, bool nprocGiven) {
  if (config.devices.empty()) {
    return config.shareDevices ? "--share-devices needs --devices (e.g. --devices cuda:0,cuda:0)"
                               : "";
  }
  const int n = static_cast<int>(config.devices.size());
  if (nprocGiven && n != config.nprocPerNode) {
    return "--devices lists " + std::to_string(n) + " device(s) but --nproc-per-node is " +
           std::to_string(config.nprocPerNode) +
           ": give one device per local rank (or leave --nproc-per-node out)";
  }
  config.nprocPerNode = n;
  std::vector<std::string> cuda;  // the CUDA device of each entry, "" for the CPU
  int nextCuda = 0;
  for (int i = 0; i < n; ++i) {
    std::string d = config.devices[static_cast<size_t>(i)];
    for (auto& c : d) {
      c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    const bool indexed = d.size() > 5 && d.size() <= 8 && d.rfind("cuda:", 0) == 0 &&
                         d.find_first_not_of("0123456789", 5) == std::string::npos;
    if (d != "cpu" && d != "cuda" && !indexed) {
      return "--devices entry " + std::to_string(i) + " '" +
             config.devices[static_cast<size_t>(i)] +
             "' is not a device; use cpu, cuda or cuda:N, one per local rank (e.g. "
             "--devices cuda:0,cpu)";
    }
    if (d == "cuda") {
      d = "cuda:" + std::to_string(nextCuda);
    }
    if (d != "cpu") {
      nextCuda = std::stoi(d.substr(5)) + 1;
      for (int j = 0; j < i && !config.shareDevices; ++j) {
        if (cuda[static_cast<size_t>(j)] == d) {
          return "--devices gives " + d + " to local ranks " + std::to_string(j) + " and " +
                 std::to_string(i) +
                 "; each rank needs its own GPU, or add --share-devices to share it over Gloo "
                 "(testing)";
        }
      }
    }
    cuda.push_back(d == "cpu" ? "" : d);
  }
  return "";
}

int launch(const LaunchConfig& config) {
  if (pipe2(gSignalPipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    say(std::string("cannot create the signal pipe: ") + std::strerror(errno));
    return 1;
  }
  struct sigaction sa {};
  sa.sa_handler = onSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);
  struct sigaction child {};
  child.sa_handler = onSignal;  // wakes the supervision loop the moment a rank ends
  sigemptyset(&child.sa_mask);
  child.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  sigaction(SIGCHLD, &child, nullptr);
  signal(SIGPIPE, SIG_IGN);

  const int world = config.nnodes * config.nprocPerNode;
  if (config.nprocPerNode > 1 && !std::getenv("OMP_NUM_THREADS")) {
    say("setting OMP_NUM_THREADS=1 for each rank (set it yourself to choose another value)");
  }
  int result = 0;
  for (int attempt = 0; attempt <= config.maxRestarts; ++attempt) {
    const int port = config.masterPort > 0 ? config.masterPort : freePort();
    say("starting " + std::to_string(config.nprocPerNode) + " rank(s) of " + std::to_string(world) +
        " (node " + std::to_string(config.nodeRank) + "/" + std::to_string(config.nnodes) +
        "), store " + config.masterAddr + ":" + std::to_string(port) +
        (attempt > 0 ? ", restart " + std::to_string(attempt) : ""));
    Group group(config, port, attempt);
    if (!group.start()) {
      group.supervise();
      return 1;
    }
    const Group::Outcome outcome = group.supervise();
    result = outcome.exitCode;
    if (result == 0) {
      return 0;
    }
    if (outcome.interrupted) {
      return result >= 128 ? result : 130;
    }
    if (attempt < config.maxRestarts) {
      say("restarting the group (" + std::to_string(attempt + 1) + " of " +
          std::to_string(config.maxRestarts) + " restarts)");
    }
  }
  say("job failed (exit code " + std::to_string(result) + ")");
  return result;
}

}  // namespace run
}  // namespace hddp
