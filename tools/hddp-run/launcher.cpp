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
#include <filesystem>
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
  int slot = 0;  // the local slot (elastic: the same device across generations)
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  int64_t endedInSweep = -1;  // the reap() sweep that found it ended (order of failures)
  Stream out;
  Stream err;
};

class Group {
 public:
  // `slots`: the local slots that run a rank this time (elastic mode), in rank order;
  // empty: every local rank, as without elasticity.
  Group(const LaunchConfig& config, int port, int restartCount, std::vector<int> slots = {},
        std::string elasticDir = {})
      : config_(config),
        port_(port),
        restartCount_(restartCount),
        slots_(std::move(slots)),
        elasticDir_(std::move(elasticDir)) {}

  bool start() {
    const bool elastic = config_.minProcs > 0;
    if (!elastic) {
      for (int local = 0; local < config_.nprocPerNode; ++local) {
        slots_.push_back(local);
      }
    }
    const int localRanks = static_cast<int>(slots_.size());
    const int world = config_.nnodes * localRanks;
    for (int index = 0; index < localRanks; ++index) {
      const int slot = slots_[static_cast<size_t>(index)];
      Rank rank;
      rank.globalRank = config_.nodeRank * localRanks + index;
      rank.slot = slot;
      int outPipe[2];
      int errPipe[2];
      if (pipe2(outPipe, O_CLOEXEC) != 0 || pipe2(errPipe, O_CLOEXEC) != 0) {
        say(std::string("cannot create pipes: ") + std::strerror(errno));
        return false;
      }
      // Elastic: the ranks are numbered afresh each generation; HDDP_SLOT keeps each one
      // on its slot's device (cuda:<slot>, or the slot's entry of --devices).
      std::vector<std::string> env = {
          "RANK=" + std::to_string(rank.globalRank),
          "WORLD_SIZE=" + std::to_string(world),
          "LOCAL_RANK=" + std::to_string(index),
          "LOCAL_WORLD_SIZE=" + std::to_string(localRanks),
          "GROUP_RANK=" + std::to_string(config_.nodeRank),
          "MASTER_ADDR=" + config_.masterAddr,
          "MASTER_PORT=" + std::to_string(port_),
          "TORCHELASTIC_RESTART_COUNT=" + std::to_string(restartCount_),
          "TORCHELASTIC_MAX_RESTARTS=" + std::to_string(config_.maxRestarts),
          "TORCHELASTIC_RUN_ID=hddp-" + std::to_string(getpid()),
      };
      if (elastic) {
        env.push_back("HDDP_ELASTIC=1");
        env.push_back("HDDP_SLOT=" + std::to_string(slot));
        env.push_back("HDDP_ELASTIC_DIR=" + elasticDir_);
      }
      if (!config_.devices.empty()) {
        std::string list;
        for (int active : slots_) {
          list += (list.empty() ? "" : ",") + config_.devices[static_cast<size_t>(active)];
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
        if (localRanks > 1 && !getenv("OMP_NUM_THREADS")) {
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
      std::string prefix = "[rank " + std::to_string(rank.globalRank) +
                           (elastic ? ", slot " + std::to_string(slot) : std::string()) + "] ";
      if (config_.noPrefix) {
        prefix.clear();
      }
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
    bool reform = false;       // elastic: the ranks left at a commit to re-form the group
    // Elastic: the slots whose rank failed (before the others were stopped), and how.
    std::vector<std::pair<int, std::string>> failed;
  };

  // Elastic mode: SIGUSR1 to every rank, once; they commit and leave with
  // kReformExitCode at the next commit.
  void requestReform() {
    if (!reformRequested_) {
      reformRequested_ = true;
      // A file for the ranks still starting (not yet listening for the signal), the
      // signal for the others; the ranks look for both at each commit.
      const int fd =
          ::open((elasticDir_ + "/reform").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
      if (fd >= 0) {
        ::close(fd);
      }
      for (const auto& r : ranks_) {
        if (r.running) {
          kill(r.pid, SIGUSR1);
        }
      }
    }
  }
  bool reformRequested() const { return reformRequested_; }

  // Kills the rank of `slot` (and its process group); false when it is not running.
  bool killSlot(int slot, int sig) {
    for (const auto& r : ranks_) {
      if (r.slot == slot && r.running) {
        kill(-r.pid, sig);
        kill(r.pid, sig);
        return true;
      }
    }
    return false;
  }
  int rankOfSlot(int slot) const {
    for (const auto& r : ranks_) {
      if (r.slot == slot) {
        return r.globalRank;
      }
    }
    return -1;
  }

  // Runs until all ranks ended, one failed, or a signal arrived; `tick` runs between
  // polls (elastic mode: unplug emulation and rejoin checks).
  template <typename Tick>
  Outcome supervise(Tick&& tick) {
    bool interrupted = false;
    bool stopping = false;
    std::vector<std::pair<int, std::string>> failedSlots;
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
            if (&r != first && failed(r)) {
              say("rank " + std::to_string(r.globalRank) + " " + describeStatus(r.status) +
                  " at the same time");
            }
          }
          result = exitCodeOf(first->status);
          stopping = true;
          for (const auto& r : ranks_) {
            if (!r.running && failed(r)) {
              failedSlots.emplace_back(
                  r.slot, "rank " + std::to_string(r.globalRank) + " " + describeStatus(r.status));
            }
          }
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
      if (!stopping) {
        tick(*this);
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
    Outcome outcome{result, interrupted, false, std::move(failedSlots)};
    for (const auto& r : ranks_) {
      outcome.reform = outcome.reform || (result == 0 && leftToReform(r));
    }
    return outcome;
  }
  Outcome supervise() {
    return supervise([](Group&) {});
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
      if (!r.running && failed(r) && (!first || before(r, *first))) {
        first = &r;
      }
    }
    return first;
  }

  // Elastic mode: the rank left at a commit for the group to re-form.
  bool leftToReform(const Rank& r) const {
    return config_.minProcs > 0 && !r.running && WIFEXITED(r.status) &&
           WEXITSTATUS(r.status) == kReformExitCode;
  }
  bool failed(const Rank& r) const { return !r.running && r.status != 0 && !leftToReform(r); }

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
  std::vector<int> slots_;
  std::string elasticDir_;
  std::vector<Rank> ranks_;
  int64_t sweep_ = 0;
  bool reformRequested_ = false;
};

}  // namespace

std::string siblingTool(const std::string& name) {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) {
    return "";
  }
  for (const auto& candidate :
       {self.parent_path() / name, self.parent_path().parent_path() / name / name}) {
    if (::access(candidate.c_str(), X_OK) == 0) {
      return candidate.string();
    }
  }
  return "";
}

std::string parseNproc(const std::string& text, LaunchConfig& config) {
  auto number = [](const std::string& t, int* out) {
    if (t.empty() || t.size() > 5 || t.find_first_not_of("0123456789") != std::string::npos) {
      return false;
    }
    *out = std::stoi(t);
    return *out >= 1 && *out <= 4096;
  };
  const size_t colon = text.find(':');
  if (colon == std::string::npos) {
    config.minProcs = 0;
    if (number(text, &config.nprocPerNode)) {
      return "";
    }
  } else if (number(text.substr(0, colon), &config.minProcs) &&
             number(text.substr(colon + 1), &config.nprocPerNode)) {
    if (config.minProcs <= config.nprocPerNode) {
      return "";
    }
    return "--nproc-per-node " + text + ": MIN is above MAX; give MIN:MAX with MIN <= MAX";
  }
  return "--nproc-per-node '" + text +
         "' is not a rank count: give N (1 to 4096) or MIN:MAX for an elastic job (e.g. 2:3)";
}

std::string parseUnplug(const std::string& text, LaunchConfig& config) {
  LaunchConfig::Unplug u;
  const size_t at = text.find('@');
  const size_t colon = text.find(':', at == std::string::npos ? 0 : at);
  auto seconds = [](const std::string& t, double* out) {
    char* end = nullptr;
    *out = std::strtod(t.c_str(), &end);
    return !t.empty() && end && *end == '\0' && *out >= 0;
  };
  bool ok = at != std::string::npos && at > 0 &&
            text.substr(0, at).find_first_not_of("0123456789") == std::string::npos;
  if (ok) {
    u.slot = std::stoi(text.substr(0, at));
    ok =
        seconds(
            text.substr(at + 1, colon == std::string::npos ? std::string::npos : colon - at - 1),
            &u.at) &&
        (colon == std::string::npos || (seconds(text.substr(colon + 1), &u.back) && u.back > u.at));
  }
  if (!ok) {
    return "--emulate-unplug '" + text +
           "' is not SLOT@SECONDS[:BACK] (e.g. 2@30:60: slot 2 is killed 30 s after the start "
           "and can come back at 60 s)";
  }
  if (u.slot >= config.nprocPerNode) {
    return "--emulate-unplug '" + text + "': there is no slot " + std::to_string(u.slot) +
           " (slots 0.." + std::to_string(config.nprocPerNode - 1) + ")";
  }
  config.unplugs.push_back(u);
  return "";
}

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
    config.devices[static_cast<size_t>(i)] = d;  // resolved: an elastic job passes subsets
  }
  return "";
}

namespace {

double secondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// One local slot of an elastic job: whether it runs a rank, and why not.
struct Slot {
  bool away = false;    // left (failed, unplugged); back only when its check passes
  bool back = false;    // its rejoin check passed: it joins at the next re-forming
  std::string why;      // why it left
  pid_t checkPid = -1;  // a rejoin check in flight
  double leftAt = 0;    // seconds since the job started
};

// The slot's device as the ranks will see it: entry <slot> of --devices, else the
// default (cuda:<slot> with CUDA, which the check itself finds out).
std::string slotDevice(const LaunchConfig& config, int slot) {
  return config.devices.empty() ? "" : config.devices[static_cast<size_t>(slot)];
}

// Starts the rejoin check of `slot` (asynchronously: a shell command, or hddp-probe
// for a CUDA slot). Returns -1 when the slot needs no check (a CPU slot, no command):
// it is available.
pid_t startRejoinCheck(const LaunchConfig& config, int slot) {
  const std::string device = slotDevice(config, slot);
  std::vector<std::string> argv;
  if (!config.rejoinCheck.empty()) {
    argv = {"/bin/sh", "-c", config.rejoinCheck};
  } else if (device == "cpu" || config.probePath.empty()) {
    return -1;
  } else {
    argv = {config.probePath, "--check-device",
            device.empty() ? "slot:" + std::to_string(slot) : device};
  }
  const pid_t pid = fork();
  if (pid == 0) {
    setenv("HDDP_SLOT", std::to_string(slot).c_str(), 1);
    setenv("HDDP_SLOT_DEVICE", device.c_str(), 1);
    const int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0) {
      dup2(devnull, STDOUT_FILENO);
    }
    std::vector<char*> args;
    for (auto& a : argv) {
      args.push_back(const_cast<char*>(a.c_str()));
    }
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return pid;
}

std::string makeElasticDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/hddp-elastic-XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  return mkdtemp(buf.data()) ? std::string(buf.data()) : std::string();
}

int launchElastic(const LaunchConfig& config) {
  const auto jobStart = std::chrono::steady_clock::now();
  std::vector<Slot> slots(static_cast<size_t>(config.nprocPerNode));
  std::vector<bool> unplugDone(config.unplugs.size(), false);
  const std::string dir = makeElasticDir();
  if (dir.empty()) {
    say(std::string("cannot create the elastic state folder: ") + std::strerror(errno));
    return 1;
  }
  say("elastic: " + std::to_string(config.minProcs) + " to " + std::to_string(config.nprocPerNode) +
      " ranks; commits in " + dir + " unless the program saves elsewhere (--save-dir)");
  for (const auto& u : config.unplugs) {
    say("emulation: slot " + std::to_string(u.slot) + " is unplugged " + std::to_string(u.at) +
        " s after the start" +
        (u.back >= 0 ? " and back " + std::to_string(u.back) + " s after the start"
                     : ", for good"));
  }
  int failures = 0;
  for (int generation = 0;; ++generation) {
    std::vector<int> active;
    std::string awayText;
    for (int i = 0; i < config.nprocPerNode; ++i) {
      Slot& slot = slots[static_cast<size_t>(i)];
      if (slot.back) {
        slot = Slot{};
      }
      if (!slot.away) {
        active.push_back(i);
      } else {
        awayText += "; slot " + std::to_string(i) + ": " + slot.why;
      }
    }
    if (static_cast<int>(active.size()) < config.minProcs) {
      say("only " + std::to_string(active.size()) + " of " + std::to_string(config.nprocPerNode) +
          " slots can run a rank, fewer than the minimum " + std::to_string(config.minProcs) +
          awayText + "; ending the job");
      say("job failed (exit code 1)");
      return 1;
    }
    const int port = config.masterPort > 0 ? config.masterPort : freePort();
    std::string slotList;
    for (int a : active) {
      slotList += (slotList.empty() ? "" : ",") + std::to_string(a);
    }
    say("generation " + std::to_string(generation) + ": " + std::to_string(active.size()) +
        " rank(s) on slots " + slotList + ", store " + config.masterAddr + ":" +
        std::to_string(port));
    std::error_code ec;
    std::filesystem::remove(dir + "/reform", ec);  // the last generation's request is met
    Group group(config, port, generation, active, dir);
    if (!group.start()) {
      group.supervise();
      return 1;
    }
    auto lastCheck = std::chrono::steady_clock::now();
    const Group::Outcome outcome = group.supervise([&](Group& g) {
      const double now = secondsSince(jobStart);
      for (size_t u = 0; u < config.unplugs.size(); ++u) {
        const auto& unplug = config.unplugs[u];
        if (!unplugDone[u] && now >= unplug.at) {
          unplugDone[u] = true;
          if (g.killSlot(unplug.slot, SIGKILL)) {
            say("emulation: unplugging slot " + std::to_string(unplug.slot) + " (rank " +
                std::to_string(g.rankOfSlot(unplug.slot)) + ") at " + std::to_string(now) + " s");
          }
        }
      }
      // Rejoin checks of the slots that left, every rejoinEvery seconds.
      for (int i = 0; i < config.nprocPerNode; ++i) {
        Slot& slot = slots[static_cast<size_t>(i)];
        if (slot.checkPid > 0) {
          int status = 0;
          if (waitpid(slot.checkPid, &status, WNOHANG) == slot.checkPid) {
            slot.checkPid = -1;
            slot.back = WIFEXITED(status) && WEXITSTATUS(status) == 0;
          }
        }
      }
      if (g.reformRequested() || secondsSince(lastCheck) < config.rejoinEvery) {
        return;
      }
      lastCheck = std::chrono::steady_clock::now();
      std::string backList;
      for (int i = 0; i < config.nprocPerNode; ++i) {
        Slot& slot = slots[static_cast<size_t>(i)];
        if (!slot.away || slot.checkPid > 0) {
          continue;
        }
        bool emulatedAway = false;
        for (const auto& u : config.unplugs) {
          emulatedAway =
              emulatedAway || (u.slot == i && now >= u.at && (u.back < 0 || now < u.back));
        }
        if (!slot.back && !emulatedAway) {
          slot.checkPid = startRejoinCheck(config, i);
          slot.back = slot.checkPid < 0;
        }
        if (slot.back) {
          backList += (backList.empty() ? "" : ",") + std::to_string(i);
        }
      }
      if (!backList.empty()) {
        say("slot(s) " + backList + " can run again " + std::to_string(now) +
            " s after the start; the group re-forms with them at the next commit");
        g.requestReform();
      }
    });
    if (outcome.interrupted) {
      return outcome.exitCode >= 128 ? outcome.exitCode : 130;
    }
    if (outcome.exitCode == 0 && !outcome.reform) {
      say("job done after " + std::to_string(generation + 1) + " generation(s), " +
          std::to_string(secondsSince(jobStart)) + " s");
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
      return 0;
    }
    if (outcome.reform) {
      say("the ranks committed and left to re-form the group");
      continue;
    }
    for (const auto& [slot, why] : outcome.failed) {
      Slot& s = slots[static_cast<size_t>(slot)];
      s.away = true;
      s.back = false;
      s.why = why;
      s.leftAt = secondsSince(jobStart);
      say("slot " + std::to_string(slot) + " left: " + why);
    }
    if (++failures > config.maxRestarts) {
      say("job failed (exit code " + std::to_string(outcome.exitCode) +
          "): " + std::to_string(failures) + " failure(s), more than --max-restarts " +
          std::to_string(config.maxRestarts));
      return outcome.exitCode;
    }
    say("re-forming without the slot(s) that left (" + std::to_string(failures) + " of " +
        std::to_string(config.maxRestarts) + " failures allowed)");
  }
}

}  // namespace

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
  if (config.minProcs > 0) {
    return launchElastic(config);
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
