// The process supervision behind hddp-run; no LibTorch here, it only starts programs.
#pragma once

#include <string>
#include <vector>

#include "hddp_protocol/launch.h"

namespace hddp {
namespace run {

struct LaunchConfig {
  int nprocPerNode = 1;
  int nnodes = 1;
  int nodeRank = 0;
  std::string masterAddr = "127.0.0.1";
  int masterPort = 0;
  int maxRestarts = 0;
  double graceSeconds = 5.0;
  bool noPrefix = false;
  /// When hddp-run's stderr is a terminal, rank 0's stderr is a pseudo-terminal (its
  /// live progress bar shows, unprefixed); --no-tty gives it a pipe like the others.
  bool tty = true;
  /// One device per local rank (--devices), passed to every rank as HDDP_DEVICE; empty:
  /// the ranks choose (cuda:<local rank> with CUDA, else cpu).
  std::vector<std::string> devices;
  /// --share-devices: HDDP_ALLOW_SHARED_DEVICE=1 for every rank.
  bool shareDevices = false;
  std::vector<std::string> command;

  // Elastic membership (--nproc-per-node MIN:MAX; docs/elastic.md).
  /// MIN of --nproc-per-node MIN:MAX (nprocPerNode holds MAX); 0: not elastic.
  int minProcs = 0;
  /// Shell command that says whether a slot that left may come back (exit 0: yes); it
  /// sees HDDP_SLOT and HDDP_SLOT_DEVICE. Empty: the slot's device answers (CPU slots
  /// always do; CUDA slots: hddp-probe --check-device).
  std::string rejoinCheck;
  /// Seconds between rejoin checks of the slots that left.
  double rejoinEvery = 2.0;
  /// Emulated unplugging (tests, demos): slot `slot` is killed (SIGKILL) `at` seconds
  /// after the job starts and may come back `back` seconds after it (< 0: never).
  struct Unplug {
    int slot = 0;
    double at = 0;
    double back = -1;
  };
  std::vector<Unplug> unplugs;
  /// --job-dir: the job's folder (commits without --save-dir, the job record job.jsonl),
  /// kept after the job. Empty: a temporary folder, removed when the job succeeds.
  std::string jobDir;
  /// hddp-probe, for the default rejoin check of CUDA slots.
  std::string probePath;
};

/// The exit code with which a rank leaves at a commit so that the group re-forms
/// (hddp-run asked for it with SIGUSR1): the launch protocol's.
constexpr int kReformExitCode = protocol::kReformExitCode;

/// A usage error: the exit code of a configuration error (2, hddp's trainers) or of a
/// command line that CLI11 rejects (100 to 114, e.g. 105 for a value out of range).
/// Every rank gets the same one, so re-forming without a slot cannot help.
inline bool isUsageExitCode(int code) { return code == 2 || (code >= 100 && code <= 114); }

/// Parses --nproc-per-node: "N" or "MIN:MAX" (elastic). Returns the error to print.
std::string parseNproc(const std::string& text, LaunchConfig& config);
/// The path of tool `name` next to this program (installed side by side, or in the
/// build tree's tools/<name>/), or "" when there is none.
std::string siblingTool(const std::string& name);
/// Parses one --emulate-unplug entry, SLOT@AT[:BACK] in seconds (e.g. 2@30:60).
std::string parseUnplug(const std::string& text, LaunchConfig& config);

/// Checks --devices against --nproc-per-node (`nprocGiven`: whether it was given; if not,
/// it becomes the list's length): each entry cpu, cuda or cuda:N, no CUDA device twice
/// unless shareDevices. Returns the error to print, empty when the list is good.
std::string checkDevices(LaunchConfig& config, bool nprocGiven);

/// Runs the job; returns the exit status for hddp-run: 0 when every rank succeeded,
/// else the failed rank's exit code (128 + signal when it was killed), 130 on Ctrl-C.
int launch(const LaunchConfig& config);

}  // namespace run
}  // namespace hddp
