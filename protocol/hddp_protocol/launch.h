// The launch protocol between hddp-run and the ranks it starts (docs/elastic.md), in one
// place for both sides: libhddp (the Trainer's elastic part), hddp-run, hddp-probe and the
// tests. Torch-free. Besides these, hddp-run sets torchrun's variables (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
// TORCHELASTIC_MAX_RESTARTS), which comm/launch.h reads.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace hddp {
namespace protocol {

/// Exit code of a rank that committed and left for the group to re-form (EX_TEMPFAIL);
/// hddp-run starts the next generation on it instead of counting a failure.
constexpr int kReformExitCode = 75;

// ---- the environment of a rank ------------------------------------------------------
/// "hddp-run" in every rank hddp-run starts: the launch is hddp-run's, though it uses
/// torchrun's variables (comm/launch.h reports Launcher::HddpRun, not torchrun).
constexpr const char* kEnvLauncher = "HDDP_LAUNCHER";
constexpr const char* kLauncherHddpRun = "hddp-run";
/// "1" when hddp-run starts each line of the rank's stderr with "[rank N] " (else "0":
/// --no-prefix, or rank 0's terminal): hddp's log lines then leave the rank out of their
/// own prefix, so that it appears once.
constexpr const char* kEnvRankPrefixed = "HDDP_RANK_PREFIXED";
/// The TORCHELASTIC_RUN_ID hddp-run gave its ranks. HDDP_LAUNCHER and
/// HDDP_RANK_PREFIXED describe the process only while TORCHELASTIC_RUN_ID still equals
/// it: a launcher started under hddp-run (`hddp-run -- script.sh` running torchrun)
/// passes them on to its own workers, but torchrun sets its own TORCHELASTIC_RUN_ID.
constexpr const char* kEnvLauncherRunId = "HDDP_LAUNCHER_RUN_ID";
/// "1" in an elastic job (hddp-run --nproc-per-node MIN:MAX).
constexpr const char* kEnvElastic = "HDDP_ELASTIC";
/// The rank's slot: its local device, stable across generations.
constexpr const char* kEnvSlot = "HDDP_SLOT";
/// The job's folder: commits without a save folder, the job record, the re-form file.
constexpr const char* kEnvElasticDir = "HDDP_ELASTIC_DIR";
/// The slots that run a rank in this generation, in rank order ("0,2").
constexpr const char* kEnvSlots = "HDDP_SLOTS";
/// The node's slot count (--nproc-per-node MAX).
constexpr const char* kEnvSlotCount = "HDDP_SLOT_COUNT";
/// How often the launcher restarted the job (torchrun's name; hddp-run sets it too).
constexpr const char* kEnvRestartCount = "TORCHELASTIC_RESTART_COUNT";
/// The job's id (torchrun's rendezvous id; hddp-run's "hddp-<pid>").
constexpr const char* kEnvRunId = "TORCHELASTIC_RUN_ID";

// ---- files in the job's folder -------------------------------------------------------
/// Created by hddp-run to ask for a re-form (with SIGUSR1 to the ranks listening).
constexpr const char* kReformFile = "reform";
/// The job record (hddp_protocol/job_record.h).
constexpr const char* kJobRecordFile = "job.jsonl";

/// A rank's progress mark: the last step it finished, in `<dir>/progress.slot<N>` of
/// the commit folder, two int64 values (job, step) at offset 0 in host byte order.
struct ProgressMark {
  int64_t job = 0;  // progressMarkJob() of the writer: marks of another job do not count
  int64_t step = -1;
};
/// "<dir>/progress.slot<slot>".
std::string progressMarkPath(const std::string& dir, int slot);
/// The slot of a mark's file name ("progress.slot2" -> 2); nullopt for another name.
std::optional<int> progressMarkSlot(const std::string& fileName);
/// Reads a mark; nullopt when the file is missing or short.
std::optional<ProgressMark> readProgressMark(const std::string& path);
/// Writes `mark` at offset 0 of the open file `fd` (no fsync: a hint for the log).
void writeProgressMark(int fd, const ProgressMark& mark);
/// This job's id for its marks, from TORCHELASTIC_RUN_ID (a hash; 0 when unset).
int64_t progressMarkJob();

}  // namespace protocol
}  // namespace hddp
