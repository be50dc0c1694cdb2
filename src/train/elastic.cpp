#include "train/elastic.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>

#include "hddp/core/env.h"
#include "hddp/core/error.h"

namespace hddp {
namespace train {
namespace {

std::atomic<bool> gReform{false};

void onReformRequest(int) { gReform.store(true); }

}  // namespace

ElasticEnv elasticFromEnv() {
  ElasticEnv e;
  const char* on = std::getenv(protocol::kEnvElastic);
  e.enabled = on && std::string(on) == "1";
  if (const char* slot = std::getenv(protocol::kEnvSlot)) {
    char* end = nullptr;
    const long v = std::strtol(slot, &end, 10);
    HDDP_CHECK_AS(ConfigError, end != slot && *end == '\0' && v >= 0, "HDDP_SLOT='", slot,
                  "' is not a slot number (hddp-run sets it in an elastic job)");
    e.slot = static_cast<int>(v);
  }
  if (const char* dir = std::getenv(protocol::kEnvElasticDir)) {
    e.dir = dir;
  }
  return e;
}

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

void SampleLog::open(int rank, int generation) {
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
  std::fprintf(file_, "%d %lld %d", generation_, static_cast<long long>(step), rank);
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

int64_t ProgressMark::newest(const std::string& dir) {
  int64_t newest = -1;
  const int64_t job = protocol::progressMarkJob();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (!protocol::progressMarkSlot(entry.path().filename().string())) {
      continue;
    }
    const auto mark = protocol::readProgressMark(entry.path().string());
    if (mark && mark->job == job) {
      newest = std::max<int64_t>(newest, mark->step);
    }
  }
  return newest;
}

}  // namespace train
}  // namespace hddp
