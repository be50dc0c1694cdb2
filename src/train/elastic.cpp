#include "train/elastic.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>

#include "hddp/core/error.h"

namespace hddp {
namespace train {
namespace {

std::atomic<bool> gReform{false};

void onReformRequest(int) { gReform.store(true); }

}  // namespace

ElasticEnv elasticFromEnv() {
  ElasticEnv e;
  const char* on = std::getenv("HDDP_ELASTIC");
  e.enabled = on && std::string(on) == "1";
  if (const char* slot = std::getenv("HDDP_SLOT")) {
    char* end = nullptr;
    const long v = std::strtol(slot, &end, 10);
    HDDP_CHECK_AS(ConfigError, end != slot && *end == '\0' && v >= 0, "HDDP_SLOT='", slot,
                  "' is not a slot number (hddp-run sets it in an elastic job)");
    e.slot = static_cast<int>(v);
  }
  if (const char* dir = std::getenv("HDDP_ELASTIC_DIR")) {
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
  const char* path = std::getenv("HDDP_LOG_SAMPLES");
  if (!path || !*path || file_) {
    return;
  }
  const std::string mine = std::string(path) + ".rank" + std::to_string(rank);
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

}  // namespace train
}  // namespace hddp
