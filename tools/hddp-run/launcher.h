// The process supervision behind hddp-run; no LibTorch here, it only starts programs.
#pragma once

#include <string>
#include <vector>

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
  /// One device per local rank (--devices), passed to every rank as HDDP_DEVICE; empty:
  /// the ranks choose (cuda:<local rank> with CUDA, else cpu).
  std::vector<std::string> devices;
  /// --share-devices: HDDP_ALLOW_SHARED_DEVICE=1 for every rank.
  bool shareDevices = false;
  std::vector<std::string> command;
};

/// Checks --devices against --nproc-per-node (`nprocGiven`: whether it was given; if not,
/// it becomes the list's length): each entry cpu, cuda or cuda:N, no CUDA device twice
/// unless shareDevices. Returns the error to print, empty when the list is good.
std::string checkDevices(LaunchConfig& config, bool nprocGiven);

/// Runs the job; returns the exit status for hddp-run: 0 when every rank succeeded,
/// else the failed rank's exit code (128 + signal when it was killed), 130 on Ctrl-C.
int launch(const LaunchConfig& config);

}  // namespace run
}  // namespace hddp
