#include "group.h"

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

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace hddp {
namespace run {
namespace detail {

bool Group::start() {
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
    // Rank 0 on a terminal: its stderr is a pseudo-terminal, so its live bar shows.
    const bool tty = rank.globalRank == 0 && config_.tty && isatty(STDERR_FILENO) &&
                     openPseudoTerminal(ptyMaster_, ptySlave_);
    if (tty) {
      close(errPipe[0]);
      close(errPipe[1]);
      errPipe[0] = ptyMaster_;
      errPipe[1] = ptySlave_;
    }
    // Elastic: the ranks are numbered afresh each generation; HDDP_SLOT keeps each one
    // on its slot's device (cuda:<slot>, or the slot's entry of --devices).
    const std::string runId = "hddp-" + std::to_string(getpid());
    std::vector<std::string> env = {
        "RANK=" + std::to_string(rank.globalRank),
        "WORLD_SIZE=" + std::to_string(world),
        "LOCAL_RANK=" + std::to_string(index),
        "LOCAL_WORLD_SIZE=" + std::to_string(localRanks),
        "GROUP_RANK=" + std::to_string(config_.nodeRank),
        "MASTER_ADDR=" + config_.masterAddr,
        "MASTER_PORT=" + std::to_string(port_),
        std::string(protocol::kEnvRestartCount) + "=" + std::to_string(restartCount_),
        "TORCHELASTIC_MAX_RESTARTS=" + std::to_string(config_.maxRestarts),
        std::string(protocol::kEnvRunId) + "=" + runId,
        std::string(protocol::kEnvLauncher) + "=" + protocol::kLauncherHddpRun,
        std::string(protocol::kEnvLauncherRunId) + "=" + runId,
        // Set either way, so that a value from an outer hddp-run is not inherited.
        std::string(protocol::kEnvRankPrefixed) + "=" + (tty || config_.noPrefix ? "0" : "1"),
    };
    if (elastic) {
      env.push_back(std::string(protocol::kEnvElastic) + "=1");
      env.push_back(std::string(protocol::kEnvSlot) + "=" + std::to_string(slot));
      env.push_back(std::string(protocol::kEnvElasticDir) + "=" + elasticDir_);
      // Per-rank lists (--emulate-*, --max-local-batch) name slots in an elastic job.
      std::string slotList;
      for (int active : slots_) {
        slotList += (slotList.empty() ? "" : ",") + std::to_string(active);
      }
      env.push_back(std::string(protocol::kEnvSlots) + "=" + slotList);
      env.push_back(std::string(protocol::kEnvSlotCount) + "=" +
                    std::to_string(config_.nprocPerNode));
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
    // Signals stay blocked across fork until the child has reset hddp-run's handlers:
    // a SIGTERM (stopping a generation) that reached a child before its exec would
    // otherwise run hddp-run's handler there and write into the signal pipe it shares,
    // which hddp-run then read as its own interruption.
    sigset_t blockAll;
    sigset_t previousMask;
    sigfillset(&blockAll);
    pthread_sigmask(SIG_BLOCK, &blockAll, &previousMask);
    const pid_t pid = fork();
    if (pid != 0) {
      pthread_sigmask(SIG_SETMASK, &previousMask, nullptr);
    }
    if (pid < 0) {
      say(std::string("fork failed: ") + std::strerror(errno));
      return false;
    }
    if (pid == 0) {
      signal(SIGHUP, SIG_DFL);
      signal(SIGCHLD, SIG_DFL);
      close(gSignalPipe[0]);
      close(gSignalPipe[1]);
      // Child: own process group (we forward signals ourselves), die with the launcher.
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) {
        _exit(127);
      }
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      signal(SIGPIPE, SIG_DFL);
      if (elastic) {
        // The re-form request (SIGUSR1) must not kill a rank that has not yet set up
        // its handler, nor a wrapper script around it: an ignored signal stays ignored
        // across exec, and the Trainer installs its own handler. A rank that cannot
        // receive it finds the reform file at its next commit.
        signal(SIGUSR1, SIG_IGN);
      }
      pthread_sigmask(SIG_SETMASK, &previousMask, nullptr);
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
    close(errPipe[1]);  // a pseudo-terminal's slave too: rank 0 holds it now
    rank.pid = pid;
    rank.running = true;
    std::string prefix = "[rank " + std::to_string(rank.globalRank) +
                         (elastic ? ", slot " + std::to_string(slot) : std::string()) + "] ";
    if (config_.noPrefix) {
      prefix.clear();
    }
    Terminal* terminal = isatty(STDERR_FILENO) ? &gTerminal : nullptr;
    rank.out = Stream{outPipe[0], STDOUT_FILENO, prefix, {}, terminal, false};
    rank.err = Stream{errPipe[0], STDERR_FILENO, tty ? std::string() : prefix, {}, terminal, tty};
    ranks_.push_back(std::move(rank));
  }
  return true;
}

void Group::requestReform() {
  if (!reformRequested_) {
    reformRequested_ = true;
    // A file for the ranks still starting (not yet listening for the signal), the
    // signal for the others; the ranks look for both at each commit.
    const int fd = ::open((elasticDir_ + "/" + protocol::kReformFile).c_str(),
                          O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
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

bool Group::killSlot(int slot, int sig) {
  for (const auto& r : ranks_) {
    if (r.slot == slot && r.running) {
      kill(-r.pid, sig);
      kill(r.pid, sig);
      return true;
    }
  }
  return false;
}

int Group::rankOfSlot(int slot) const {
  for (const auto& r : ranks_) {
    if (r.slot == slot) {
      return r.globalRank;
    }
  }
  return -1;
}

Group::Outcome Group::supervise(const Tick& tick) {
  bool interrupted = false;
  bool stopping = false;
  std::vector<std::pair<int, std::string>> failedSlots;
  bool usageError = false;
  bool usageGrace = false;
  std::chrono::steady_clock::time_point usageDecideAt{};
  std::chrono::steady_clock::time_point killAt{};
  int result = 0;
  while (true) {
    reap();
    if (!anyRunning()) {
      break;
    }
    const Rank* failure = stopping ? nullptr : firstFailure();
    if (failure && !usageGrace && isUsage(*failure) && config_.minProcs > 0) {
      // Elastic: a usage error is the same on every rank, which then fail on their own
      // within moments; a rank that fails alone (its device) is a departure. Wait up to
      // 2 s before deciding and stopping the others.
      usageGrace = true;
      usageDecideAt = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    }
    if (failure && usageGrace && std::chrono::steady_clock::now() < usageDecideAt) {
      bool othersLeft = false;
      for (const auto& r : ranks_) {
        othersLeft = othersLeft || (r.running && !failed(r));
      }
      if (othersLeft) {
        failure = nullptr;  // still waiting for the others
      }
    }
    if (!stopping && failure) {
      if (const Rank* first = failure) {
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
        usageError = true;
        int usageFailures = 0;
        for (const auto& r : ranks_) {
          if (!r.running && failed(r)) {
            failedSlots.emplace_back(
                r.slot, "rank " + std::to_string(r.globalRank) + " " + describeStatus(r.status));
            usageError = usageError && isUsage(r);
            usageFailures += isUsage(r) ? 1 : 0;
          }
        }
        // More than one rank (or the only one) with the same kind of error.
        usageError = usageError && (usageFailures >= 2 || ranks_.size() == 1);
      }
      if (stopping) {
        signalAll(SIGTERM);
        killAt = std::chrono::steady_clock::now() +
                 std::chrono::milliseconds(static_cast<int>(config_.graceSeconds * 1000));
      }
    } else if (stopping && std::chrono::steady_clock::now() >= killAt) {
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
      // Every rank ended before the loop saw one fail (a program that exits at once):
      // a usage error on all of them still ends an elastic job.
      bool allUsage = true;
      std::vector<std::pair<int, std::string>> usage;
      for (const auto& r : ranks_) {
        if (failed(r)) {
          allUsage = allUsage && isUsage(r);
          usage.emplace_back(
              r.slot, "rank " + std::to_string(r.globalRank) + " " + describeStatus(r.status));
        }
      }
      // Every failed rank is a departure (an elastic job re-forms without its slot),
      // unless they all failed alike with a usage error.
      if (failedSlots.empty()) {
        usageError = allUsage && (usage.size() >= 2 || ranks_.size() == 1);
        failedSlots = std::move(usage);
      }
    }
  }
  Outcome outcome{result, interrupted, false, std::move(failedSlots), usageError};
  for (const auto& r : ranks_) {
    outcome.reform = outcome.reform || (result == 0 && leftToReform(r));
  }
  return outcome;
}

const Rank* Group::firstFailure() const {
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

bool Group::leftToReform(const Rank& r) const {
  return config_.minProcs > 0 && !r.running && WIFEXITED(r.status) &&
         WEXITSTATUS(r.status) == kReformExitCode;
}

bool Group::isUsage(const Rank& r) {
  return !r.running && WIFEXITED(r.status) && isUsageExitCode(WEXITSTATUS(r.status));
}

}  // namespace detail
}  // namespace run
}  // namespace hddp
