#include "core/log_sink.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>

namespace hddp {
namespace log {
namespace sink {
namespace {

std::mutex gMutex;
std::unordered_map<std::string, std::shared_ptr<spdlog::logger>> gLoggers;
spdlog::sink_ptr gSink;
std::atomic<int> gRank{-1};
std::atomic<bool> gLauncherShowsRank{false};  // hddp-run's "[rank N] " starts each line

std::string pattern() {
  const int r = gRank.load();
  std::string rankPart =
      r >= 0 && !gLauncherShowsRank.load() ? "[rank " + std::to_string(r) + "] " : "";
  return "[%Y-%m-%d %H:%M:%S.%e] " + rankPart + "[%n] [%l] %v";
}

// Callers hold gMutex.
spdlog::logger& loggerFor(const char* layer) {
  std::string name = std::string("hddp.") + (layer ? layer : "core");
  auto it = gLoggers.find(name);
  if (it != gLoggers.end()) {
    return *it->second;
  }
  if (!gSink) {
    gSink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  }
  auto logger = std::make_shared<spdlog::logger>(name, gSink);
  logger->set_pattern(pattern());
  logger->set_level(spdlog::level::trace);  // the threshold is applied before we get here
  logger->flush_on(spdlog::level::warn);
  return *gLoggers.emplace(name, std::move(logger)).first->second;
}

}  // namespace

void write(const char* layer, int level, const char* message, std::size_t length) noexcept {
  try {
    std::lock_guard<std::mutex> lock(gMutex);
    auto lvl = static_cast<spdlog::level::level_enum>(level);
    loggerFor(layer).log(lvl, spdlog::string_view_t(message, length));
  } catch (...) {
    // Logging never throws.
  }
}

namespace {

// Callers hold gMutex.
void applyPattern() {
  for (auto& entry : gLoggers) {
    entry.second->set_pattern(pattern());
  }
}

}  // namespace

void setRank(int rank) noexcept {
  try {
    std::lock_guard<std::mutex> lock(gMutex);
    gRank.store(rank);
    applyPattern();
  } catch (...) {
  }
}

void setRankInLauncherPrefix(bool prefixed) noexcept {
  try {
    std::lock_guard<std::mutex> lock(gMutex);
    gLauncherShowsRank.store(prefixed);
    applyPattern();
  } catch (...) {
  }
}

int rank() noexcept { return gRank.load(); }

}  // namespace sink
}  // namespace log
}  // namespace hddp
