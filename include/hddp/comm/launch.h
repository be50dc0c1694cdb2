// Who am I in the job: the launchers' conventions (hddp/comm/devices.h: which device).
//
// `detectLaunch()` reads the conventions of the launchers people use, in this order
// of precedence: explicit options; torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT,
// TORCHELASTIC_USE_AGENT_STORE); Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
// SLURM_NTASKS_PER_NODE, SLURM_LAUNCH_NODE_IPADDR or the first host of
// SLURM_JOB_NODELIST); Open MPI (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK,
// _LOCAL_SIZE). With none of them: a single process (rank 0 of 1). hddp-run sets
// torchrun's variables and HDDP_LAUNCHER=hddp-run, and is reported as hddp-run (only
// while TORCHELASTIC_RUN_ID is the one hddp-run set, HDDP_LAUNCHER_RUN_ID: a torchrun
// started under hddp-run sets its own, and its workers are torchrun's). These are pure
// functions of an environment map.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "hddp/comm/communicator.h"

namespace hddp {

/// Where the launch information came from. HddpRun: torchrun's variables, set by hddp-run
/// (HDDP_LAUNCHER=hddp-run, with HDDP_LAUNCHER_RUN_ID equal to TORCHELASTIC_RUN_ID).
enum class Launcher { Explicit, Torchrun, Slurm, OpenMpi, Single, HddpRun };
const char* launcherName(Launcher launcher) noexcept;

struct LaunchInfo {
  int rank = 0;
  int worldSize = 1;
  int localRank = 0;
  int localWorldSize = 1;
  std::string masterAddr = "127.0.0.1";
  int masterPort = 29500;
  /// torchrun's attempt (TORCHELASTIC_RESTART_COUNT; hddp-run sets it): keys each
  /// attempt's rendezvous in the store.
  int restartCount = 0;
  /// How often the job was restarted: TORCHELASTIC_RESTART_COUNT, else
  /// SLURM_RESTART_COUNT (a requeued Slurm job), the first that is positive, whatever
  /// the launcher; 0 when neither is. The Trainer resumes from its save folder when > 0.
  int jobRestarts = 0;
  /// hddp-run's slot in an elastic job (HDDP_SLOT; -1: none): the default device is
  /// cuda:<slot>, so a rank keeps its GPU whichever ranks are there. Else localRank.
  int slot = -1;
  /// An elastic job of hddp-run (HDDP_ELASTIC=1): the Trainer commits and may leave for
  /// the group to re-form (docs/elastic.md).
  bool elastic = false;
  /// Where an elastic job's commits and job record go (HDDP_ELASTIC_DIR; empty: none).
  std::string elasticDir;
  /// torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True).
  bool useAgentStore = false;
  /// The launcher starts each line of this rank's stderr with its rank (hddp-run:
  /// HDDP_RANK_PREFIXED=1, with HDDP_LAUNCHER_RUN_ID equal to TORCHELASTIC_RUN_ID, so
  /// that a nested torchrun's workers do not take it); initFromEnv() then leaves it out
  /// of hddp's log lines.
  bool rankPrefixed = false;
  Launcher launcher = Launcher::Single;
};

struct InitOptions {
  std::optional<int> rank;
  std::optional<int> worldSize;
  std::optional<int> localRank;
  std::optional<int> localWorldSize;
  std::optional<std::string> masterAddr;
  std::optional<int> masterPort;
  /// Default: agreed at rendezvous, NCCL when every rank is on its own CUDA device,
  /// else Gloo (hddp/comm/devices.h). HDDP_BACKEND overrides the automatic choice;
  /// every rank must ask for the same.
  std::optional<Backend> backend;
  /// Default: HDDP_DEVICE (one device, or one per local rank), else cuda:<local rank>
  /// when CUDA is available, else CPU (resolveDevice in hddp/comm/devices.h).
  std::optional<c10::Device> device;
  /// Default: HDDP_TIMEOUT_SEC, else 30 min (Gloo) / 10 min (NCCL), like PyTorch.
  std::optional<std::chrono::milliseconds> timeout;
  /// Let several local ranks share one CUDA device (Gloo only; testing on one GPU).
  /// Default: HDDP_ALLOW_SHARED_DEVICE (false).
  std::optional<bool> allowSharedDevice;
};

/// Environment as a map, so tests can pass their own.
using EnvMap = std::map<std::string, std::string>;
EnvMap processEnvironment();

/// Launch information from `options` and `env`; throws hddp::ConfigError naming the
/// variable when values are missing or inconsistent (RANK >= WORLD_SIZE, no
/// MASTER_ADDR with WORLD_SIZE > 1, ...).
LaunchInfo detectLaunch(const InitOptions& options, const EnvMap& env);

/// Only what the launcher says about the job, not who the rank is: jobRestarts, slot,
/// elastic, elasticDir and rankPrefixed (the rest default). Never fails on the rank, world or
/// address variables: the Trainer's default when TrainerOptions::launch is not given, for a program
/// that built its communicator with explicit options.
LaunchInfo detectJob(const EnvMap& env);

/// First host of a Slurm node list: "gpu[01-04,07],login1" -> "gpu01".
std::string firstSlurmHost(const std::string& nodelist);

}  // namespace hddp
