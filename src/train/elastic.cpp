#include "train/elastic.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>

#include "hddp/comm/exchange.h"
#include "hddp/core/env.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"

namespace hddp {
namespace train {
namespace {

std::atomic<bool> gReform{false};

void onReformRequest(int) { gReform.store(true); }

}  // namespace

void watchReformRequests() {
  static std::atomic<bool> installed{false};
  if (installed.exchange(true)) {
    return;
  }
  struct sigaction sa {};
  sa.sa_handler = onReformRequest;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &sa, nullptr);
}

bool reformRequested() { return gReform.load(); }

bool reformFileExists(const std::string& dir) {
  std::error_code ec;
  return !dir.empty() && std::filesystem::exists(dir + "/" + protocol::kReformFile, ec);
}

int64_t commitInterval(double commitSeconds, double stepSeconds, double share) {
  if (!(stepSeconds > 0) || !(share > 0) || !(commitSeconds >= 0)) {
    return 10;
  }
  const double k = std::ceil(commitSeconds / (share * stepSeconds) - 1e-9);  // 10.000...02 is 10
  return static_cast<int64_t>(std::clamp(k, 1.0, 10000.0));
}

SampleLog::~SampleLog() {
  if (file_) {
    std::fclose(file_);
  }
}

void SampleLog::open(int rank, int64_t generation) {
  const std::string path = env::resolveString("HDDP_LOG_SAMPLES").value;
  if (path.empty() || file_) {
    return;
  }
  const std::string mine = path + ".rank" + std::to_string(rank);
  file_ = std::fopen(mine.c_str(), "a");
  HDDP_CHECK_AS(ConfigError, file_ != nullptr, "HDDP_LOG_SAMPLES: cannot open ", mine);
  generation_ = generation;
}

void SampleLog::write(int64_t step, int rank, const std::vector<int64_t>& indices) {
  if (!file_) {
    return;
  }
  std::fprintf(file_, "%lld %lld %d", static_cast<long long>(generation_),
               static_cast<long long>(step), rank);
  for (int64_t i : indices) {
    std::fprintf(file_, " %lld", static_cast<long long>(i));
  }
  std::fputc('\n', file_);
  std::fflush(file_);
}

ProgressMark::~ProgressMark() {
  if (fd_ >= 0) {
    ::close(fd_);
  }
}

std::string ProgressMark::path(const std::string& dir, int slot) {
  return protocol::progressMarkPath(dir, slot);
}

void ProgressMark::open(const std::string& dir, int slot) {
  if (fd_ < 0 && slot >= 0 && !dir.empty()) {
    fd_ = ::open(path(dir, slot).c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  }
}

void ProgressMark::write(int64_t step) {
  if (fd_ >= 0) {
    // The job a mark belongs to (the launcher's run id), so that marks an earlier job
    // left in a reused folder do not count.
    protocol::writeProgressMark(fd_, {protocol::progressMarkJob(), step});
  }
}

namespace {
// Each mark of this job in `dir`, with its path.
void forEachMarkOfThisJob(
    const std::string& dir,
    const std::function<void(const std::string&, int64_t job, int64_t step)>& visit) {
  const int64_t job = protocol::progressMarkJob();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (!protocol::progressMarkSlot(entry.path().filename().string())) {
      continue;
    }
    const auto mark = protocol::readProgressMark(entry.path().string());
    if (mark && mark->job == job) {
      visit(entry.path().string(), job, mark->step);
    }
  }
}
}  // namespace

int64_t ProgressMark::newest(const std::string& dir) {
  int64_t newest = -1;
  forEachMarkOfThisJob(dir, [&](const std::string&, int64_t, int64_t step) {
    newest = std::max<int64_t>(newest, step);
  });
  return newest;
}

void ProgressMark::resetAll(const std::string& dir, int64_t step) {
  forEachMarkOfThisJob(dir, [step](const std::string& path, int64_t job, int64_t) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
      protocol::writeProgressMark(fd, {job, step});
      ::close(fd);
    }
  });
}

namespace {
// A launcher's variable (not one of hddp's own, which env.h's registry holds).
std::string launcherVariable(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}
}  // namespace

ElasticRun::ElasticRun(const LaunchInfo& launch)
    : launch_(launch),
      runId_(launcherVariable(protocol::kEnvRunId)),
      // torchrun sets it ("True"/"False") in every rank's environment; hddp-run does not.
      underAgent_(!launch.elastic && !launcherVariable("TORCHELASTIC_USE_AGENT_STORE").empty()),
      recordDir_(launch.elasticDir) {
  if (underAgent_ && runId_ == "none") {
    runId_.clear();  // torchrun's default --rdzv-id: every job without one has it
  }
}

void ElasticRun::commitForAgent(const std::string& saveDir) {
  if (underAgent_ && !saveDir.empty()) {
    agentCommits_ = true;
    recordDir_ = saveDir;
  }
}

int64_t ElasticRun::begin(int rank, const std::string& saveDir) {
  (void)rank;
  if (!enabled()) {
    return -1;
  }
  watchReformRequests();
  HDDP_CHECK_AS(ConfigError, !saveDir.empty(),
                "an elastic job needs a folder for its commits: give saveDir (--save-dir) or "
                "run under hddp-run, which sets HDDP_ELASTIC_DIR");
  // Under torchrun's agent a generation after a membership change keeps the restart
  // count: the job's marks (tagged by its id) are what says it is not the first.
  return restarts() > 0 || agentCommits_ ? ProgressMark::newest(saveDir) : -1;
}

void ElasticRun::startCommits(int64_t step) {
  lastCommitTime_ = Clock::now();
  lastCommitStep_ = step;
  nextCommit_ = step + commitEvery_;
}

void ElasticRun::started(int rank, int worldSize, int64_t step, int64_t reached, bool resumed,
                         const std::string& saveDir, int64_t agreedStart) {
  // Under torchrun's agent the restart count stays through a membership change: the
  // generation's start (unix milliseconds, agreed by the ranks) tells generations apart.
  sampleLog_.open(rank, underAgent_ && agreedStart > 0 ? agreedStart : restarts());
  if (!enabled()) {
    return;
  }
  const bool restarted = restarts() > 0 || (agentCommits_ && resumed);
  if (rank == 0) {
    jobRecord_.open(recordDir_, restarts());
    const int64_t repeated = restarted ? std::max<int64_t>(0, reached - step) : 0;
    jobRecord_.add(
        restarted ? "resumed" : "started",
        {{"step", step}, {"repeated", repeated}, {"ranks", worldSize}, {"commits", saveDir}});
  }
  if (restarted && reached > step) {
    HDDP_LOG_SHARED("train", rank, "elastic: steps ", step + 1, "..", reached,
                    " were trained before the group re-formed and are trained again (",
                    reached - step, " steps)");
  } else if (restarted) {
    HDDP_LOG_SHARED("train", rank, "elastic: resumed at step ", step, "; no step is trained again");
  }
  // The steps counted now are not counted again at the next resume (every rank of each
  // folder writes the same; the Trainer's barrier follows before any rank marks a step).
  ProgressMark::resetAll(saveDir, step);
  // Under torchrun a rank has no slot: its rank names its mark (the newest of all counts).
  progressMark_.open(saveDir, slot() >= 0 ? slot() : rank);
}

void ElasticRun::stepDone(int64_t step, bool first, int rank, const std::vector<int64_t>& indices) {
  sampleLog_.write(step, rank, indices);
  progressMark_.write(step);
  if (first) {
    jobRecord_.add("first_step", {{"step", step}});
  }
}

void ElasticRun::committed(Communicator& comm, int64_t step, const std::string& file,
                           Clock::time_point saveStart) {
  if (!enabled()) {
    return;
  }
  jobRecord_.add("commit", {{"step", step}, {"file", file}});
  // Agree on a re-form request (the launcher signals the ranks one by one) and on the
  // next commit: the slowest commit against the slowest rank's wall time per step.
  const double commitSeconds = std::chrono::duration<double>(Clock::now() - saveStart).count();
  const double stepSeconds = std::chrono::duration<double>(saveStart - lastCommitTime_).count() /
                             static_cast<double>(std::max<int64_t>(1, step - lastCommitStep_));
  const bool reform = reformRequested() || reformFileExists(dir());
  const auto slowest = reduceValues(
      comm, std::array<double, 3>{reform ? 1.0 : 0.0, commitSeconds, stepSeconds}, ReduceOp::Max);
  const int64_t every = commitInterval(slowest[1], slowest[2]);
  if (every != commitEvery_) {
    HDDP_LOG_DEBUG("train", "commits every ", every, " steps (a commit takes ", slowest[1] * 1e3,
                   " ms, a step ", slowest[2] * 1e3, " ms)");
  }
  commitEvery_ = every;
  nextCommit_ = step + commitEvery_;
  lastCommitTime_ = Clock::now();
  lastCommitStep_ = step;
  if (slowest[0] > 0) {
    HDDP_LOG_SHARED("train", comm.rank(), "elastic: committed step ", step, " to ", file,
                    "; leaving for the group to re-form (exit code ", kReformExitCode, ")");
    std::fflush(nullptr);         // log lines and metrics are written through at once
    std::_Exit(kReformExitCode);  // loader threads may be mid-batch: no unwinding
  }
}

}  // namespace train
}  // namespace hddp
