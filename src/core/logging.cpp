#include "hddp/core/logging.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <mutex>

#include "core/log_sink.h"
#include "hddp/core/env.h"
#include "hddp/core/error.h"
#include "hddp/core/live_line.h"

namespace hddp {
namespace log {
namespace {

constexpr const char* kNames[] = {"trace", "debug", "info", "warn", "error", "off"};
std::atomic<int> gLevel{-1};
std::once_flag gInit;
std::mutex gHandlerMutex;
LineHandler gHandler;  // guarded by gHandlerMutex
std::atomic<bool> gHasHandler{false};
std::atomic<bool> gLiveLine{false};  // a progress bar is drawn on stderr, no newline yet

void initFromEnvironment() noexcept {
  std::call_once(gInit, [] {
    Level lvl = Level::Info;
    std::string problem;
    try {
      lvl = parseLevel(env::getString("HDDP_LOG_LEVEL"));
    } catch (const c10::Error& e) {
      problem = e.what_without_backtrace();
    } catch (const std::exception& e) {
      problem = e.what();
    }
    int expected = -1;
    gLevel.compare_exchange_strong(expected, static_cast<int>(lvl));
    if (!problem.empty()) {
      problem += "; logging at level info";
      sink::write("core", static_cast<int>(Level::Warn), problem.data(), problem.size());
    }
  });
}

}  // namespace

Level parseLevel(const std::string& text) {
  std::string lower(text);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "warning") {
    lower = "warn";
  }
  for (int i = 0; i <= static_cast<int>(Level::Off); ++i) {
    if (lower == kNames[i]) {
      return static_cast<Level>(i);
    }
  }
  HDDP_THROW(ConfigError, "unknown log level '", text,
             "'; use one of trace, debug, info, warn, error, off (HDDP_LOG_LEVEL)");
}

const char* levelName(Level level) noexcept {
  const int i = static_cast<int>(level);
  return (i >= 0 && i <= static_cast<int>(Level::Off)) ? kNames[i] : "?";
}

Level level() noexcept {
  initFromEnvironment();
  return static_cast<Level>(gLevel.load());
}

void setLevel(Level lvl) noexcept {
  initFromEnvironment();
  gLevel.store(static_cast<int>(lvl));
}

bool enabled(Level lvl) noexcept { return lvl != Level::Off && lvl >= level(); }

void setLiveLineOpen(bool open) noexcept { gLiveLine.store(open); }

bool closeLiveLine(bool clear) noexcept {
  if (!gLiveLine.exchange(false)) {
    return false;
  }
  std::fputs(clear ? "\r\033[K" : "\n", stderr);
  std::fflush(stderr);
  return true;
}

void setRank(int r) noexcept { sink::setRank(r); }

int rank() noexcept { return sink::rank(); }

void setLauncherPrefixesRank(bool prefixed) noexcept { sink::setRankInLauncherPrefix(prefixed); }

void setLineHandler(LineHandler handler) {
  std::lock_guard<std::mutex> lock(gHandlerMutex);
  gHandler = std::move(handler);
  gHasHandler.store(static_cast<bool>(gHandler));
}

void write(const char* layer, Level lvl, const std::string& message) noexcept {
  if (!enabled(lvl)) {
    return;
  }
  if (gHasHandler.load()) {
    try {
      std::lock_guard<std::mutex> lock(gHandlerMutex);
      if (gHandler) {
        const int r = rank();
        gHandler(lvl, (r >= 0 ? "[rank " + std::to_string(r) + "] " : std::string()) + "[hddp." +
                          (layer ? layer : "core") + "] [" + levelName(lvl) + "] " + message);
        return;
      }
    } catch (...) {
      return;  // a handler that throws loses its line, as logging never throws
    }
  }
  closeLiveLine(/*clear=*/true);  // the line goes where the bar was, whole
  sink::write(layer, static_cast<int>(lvl), message.data(), message.size());
}

}  // namespace log
}  // namespace hddp
