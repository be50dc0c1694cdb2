// The process supervision behind hddp-run (internal): the ranks of one group, their
// output, their ends. launcher.cpp runs groups one after another (--max-restarts),
// elastic.cpp in generations over slots (--nproc-per-node MIN:MAX). group.cpp holds the
// bodies, group_io.cpp the process helpers and the ranks' input and output.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "launcher.h"
#include "output.h"

namespace hddp {
namespace run {
namespace detail {

/// Written by the signal handlers, read by Group::pump (launcher.cpp owns it).
extern int gSignalPipe[2];

/// A free TCP port on this host (29500 when none can be found).
int freePort();
/// "exited with code 3", "was killed by signal 9 (SIGKILL)".
std::string describeStatus(int status);
/// A process's status as a shell's exit code (128 + the signal for a killed one).
int exitCodeOf(int status);

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

/// The ranks of one attempt (a generation in elastic mode). Used from hddp-run's main
/// thread only.
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

  /// Starts every rank (fork and exec, with the launcher's environment); false (said on
  /// stderr) when pipes or fork fail.
  bool start();

  // How an attempt ended.
  struct Outcome {
    int exitCode = 0;          // 0 = every rank succeeded
    bool interrupted = false;  // a signal stopped the job (no restart then)
    bool reform = false;       // elastic: the ranks left at a commit to re-form the group
    // Elastic: the slots whose rank failed (before the others were stopped), and how.
    std::vector<std::pair<int, std::string>> failed;
    // Every rank that failed exited with a usage error (isUsageExitCode).
    bool usageError = false;
  };

  // Elastic mode: SIGUSR1 to every rank, once; they commit and leave with
  // kReformExitCode at the next commit.
  void requestReform();
  bool reformRequested() const { return reformRequested_; }

  // Kills the rank of `slot` (and its process group); false when it is not running.
  bool killSlot(int slot, int sig);
  int rankOfSlot(int slot) const;

  // Runs until all ranks ended, one failed, or a signal arrived; `tick` runs between
  // polls (elastic mode: unplug emulation and rejoin checks).
  using Tick = std::function<void(Group&)>;
  Outcome supervise(const Tick& tick);
  Outcome supervise() {
    return supervise([](Group&) {});
  }

 private:
  // The rank that failed first: the earliest reap sweep (SIGCHLD wakes the launcher,
  // so a rank is normally reaped alone, before the ranks it brings down); within one
  // sweep, a rank killed by a signal before one that exited with an error (which is
  // typically a peer reporting the lost connection), then the lowest rank.
  const Rank* firstFailure() const;
  // Elastic mode: the rank left at a commit for the group to re-form.
  bool leftToReform(const Rank& r) const;
  bool failed(const Rank& r) const { return !r.running && r.status != 0 && !leftToReform(r); }
  static bool isUsage(const Rank& r);
  bool anyRunning() const;
  void reap();
  void signalAll(int sig);
  void drain(Stream& s);
  // Polls the ranks' output and the signal pipe for up to `timeoutMs`; `onSig` gets each
  // signal but SIGCHLD.
  void pump(int timeoutMs, const std::function<void(int)>& onSig);

  const LaunchConfig& config_;
  int port_;
  int restartCount_;
  std::vector<int> slots_;
  std::string elasticDir_;
  std::vector<Rank> ranks_;
  int ptyMaster_ = -1;  // rank 0's pseudo-terminal (read as its stderr), -1: none
  int ptySlave_ = -1;   // closed once rank 0 has it
  int64_t sweep_ = 0;
  bool reformRequested_ = false;
};

/// The elastic job (elastic.cpp).
int launchElastic(const LaunchConfig& config);

}  // namespace detail
}  // namespace run
}  // namespace hddp
