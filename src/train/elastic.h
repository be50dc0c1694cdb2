// The Trainer's side of an elastic job (hddp-run --nproc-per-node MIN:MAX; internal to
// the train layer, design in docs/elastic.md).
//
// The launcher runs the job in generations. Each rank commits its state every K steps
// (the state files of TrainerOptions::saveDir, else the launcher's HDDP_ELASTIC_DIR);
// when a rank fails the launcher stops the others and starts the next generation with
// the ranks left, which resume from the newest commit. When a slot may come back the
// launcher sends SIGUSR1: at the next commit every rank agrees on it, commits and
// leaves with kReformExitCode, and the next generation has the slot again.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "hddp/comm/launch.h"
#include "hddp_protocol/job_record.h"
#include "hddp_protocol/launch.h"

namespace hddp {
namespace train {

/// Exit code of a rank that committed and left for the group to re-form (the launch
/// protocol's, hddp_protocol/launch.h).
constexpr int kReformExitCode = protocol::kReformExitCode;

/// Installs the SIGUSR1 handler (once per process) that records a re-form request.
void watchReformRequests();
/// True once the launcher asked for a re-form (SIGUSR1) since the process started.
bool reformRequested();
/// True when the launcher's re-form request file (`dir`/reform) exists: the request
/// of a launcher that signalled before this process listened.
bool reformFileExists(const std::string& dir);

/// Steps between commits so that a commit costs at most `share` of the time it
/// protects: ceil(commitSeconds / (share * stepSeconds)), within [1, 10000].
int64_t commitInterval(double commitSeconds, double stepSeconds, double share = 0.02);

/// Debugging and tests: HDDP_LOG_SAMPLES=<path> appends one line per step and rank,
/// "<generation> <step> <rank> <index> <index> ...", to <path>.rank<r> of the rank. The
/// generation is the restart count, or under torchrun's agent (whose count a membership
/// change leaves) the generation's start in unix milliseconds: later generations are larger.
class SampleLog {
 public:
  SampleLog() = default;
  SampleLog(const SampleLog&) = delete;
  SampleLog& operator=(const SampleLog&) = delete;
  ~SampleLog();
  /// Opens the rank's file when HDDP_LOG_SAMPLES is set (append).
  void open(int rank, int64_t generation);
  bool enabled() const { return file_ != nullptr; }
  void write(int64_t step, int rank, const std::vector<int64_t>& indices);

 private:
  std::FILE* file_ = nullptr;
  int64_t generation_ = 0;
};

/// Each rank of an elastic job marks the last step it finished in a small file of the
/// commit folder (one per slot), so that the next generation can say which steps it
/// trains again: those after the commit it resumes from, up to the newest mark.
class ProgressMark {
 public:
  ProgressMark() = default;
  ProgressMark(const ProgressMark&) = delete;
  ProgressMark& operator=(const ProgressMark&) = delete;
  ~ProgressMark();
  void open(const std::string& dir, int slot);
  void write(int64_t step);
  /// The newest step any slot marked in `dir`; -1 when none did.
  static int64_t newest(const std::string& dir);
  /// Sets every mark of this job in `dir` to `step` (a generation's resume step, once the
  /// ranks read the marks): a mark of a generation that got further than the next one
  /// would otherwise count its steps again at the resume after.
  static void resetAll(const std::string& dir, int64_t step);

 private:
  static std::string path(const std::string& dir, int slot);
  int fd_ = -1;
};

/// The job record, `<HDDP_ELASTIC_DIR>/job.jsonl`, written by rank 0 of each generation
/// ("resumed", "first_step", "commit") through the protocol's writer
/// (hddp_protocol/job_record.h), which hddp-run and hddp-probe read.
using JobRecord = jobrecord::Writer;

/// One fit()'s bookkeeping of the launcher's protocol: the sample log (debugging), and in
/// an elastic job the progress mark, rank 0's job record and the commit schedule. Built
/// from what the launcher said (LaunchInfo); without elastic membership only the sample
/// log does anything. Used by the Trainer's thread only.
class ElasticRun {
 public:
  using Clock = std::chrono::steady_clock;

  explicit ElasticRun(const LaunchInfo& launch);
  ElasticRun(const ElasticRun&) = delete;
  ElasticRun& operator=(const ElasticRun&) = delete;

  bool enabled() const { return launch_.elastic || agentCommits_; }
  /// The launcher's commit folder (HDDP_ELASTIC_DIR; empty: none).
  const std::string& dir() const { return launch_.elasticDir; }
  /// The job's id (TORCHELASTIC_RUN_ID: torchrun's --rdzv-id, hddp-run's "hddp-<pid>";
  /// empty: none).
  const std::string& runId() const { return runId_; }
  /// torchrun's elastic agent runs the ranks (TORCHELASTIC_USE_AGENT_STORE is set, and
  /// this is not hddp-run's elastic job): it starts a new generation of ranks when a node
  /// leaves or joins, with a restart count that only failures raise, so a generation
  /// finds its job's commits by the job's id (runId()).
  bool underAgent() const { return underAgent_; }
  /// Under the agent, with a save folder: commits as in hddp-run's elastic job (the
  /// interval re-derived at each commit, progress marks, rank 0's job record in
  /// `saveDir`).
  void commitForAgent(const std::string& saveDir);
  /// The launcher's slot (-1: none): who a rank is across generations.
  int slot() const { return launch_.slot; }
  int restarts() const { return launch_.jobRestarts; }

  /// fit()'s start, before the resume: in an elastic job listens
  /// for re-form requests and says which step the previous generation reached (-1: none
  /// or not a restart), read before this generation marks any.
  int64_t begin(int rank, const std::string& saveDir);
  /// After the resume (`resumed`: from a commit), at `step`: rank 0 records the start (or
  /// resumption), the ranks say which steps are trained again (`reached`: the newest
  /// progress mark, agreed over the ranks' folders), and the progress mark opens.
  /// `agreedStart`: the generation's start in unix milliseconds, the same on every rank (the
  /// sample log's generation under torchrun's agent; 0: not known).
  void started(int rank, int worldSize, int64_t step, int64_t reached, bool resumed,
               const std::string& saveDir, int64_t agreedStart = 0);
  /// The commit schedule starts now, at `step` (after the ranks met: the first
  /// interval's time per step leaves the start-up out).
  void startCommits(int64_t step);
  /// After each step trained (`first`: the first of this fit()).
  void stepDone(int64_t step, bool first, int rank, const std::vector<int64_t>& indices);
  /// Whether a commit is due after `step` (elastic jobs; saveEvery rules otherwise).
  bool commitDue(int64_t step) const { return enabled() && step >= nextCommit_; }
  /// The elastic part of a commit whose state `file` is written (the save began at
  /// `saveStart`): the record, then the ranks agree on a re-form request and on the next
  /// commit step. Leaves the process with kReformExitCode when a re-form was requested.
  void committed(Communicator& comm, int64_t step, const std::string& file,
                 Clock::time_point saveStart);

 private:
  LaunchInfo launch_;
  std::string runId_;
  bool underAgent_ = false;
  bool agentCommits_ = false;
  std::string recordDir_;  // the job record's folder (HDDP_ELASTIC_DIR, or the save folder)
  SampleLog sampleLog_;
  ProgressMark progressMark_;
  JobRecord jobRecord_;       // rank 0
  int64_t commitEvery_ = 10;  // steps between commits (re-derived at each commit)
  int64_t nextCommit_ = 0;
  Clock::time_point lastCommitTime_;
  int64_t lastCommitStep_ = 0;
};

}  // namespace train
}  // namespace hddp
