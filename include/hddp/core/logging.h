// Logging: one named logger per layer ("hddp.core", "hddp.comm", ...), every line
// prefixed with the rank once it is known, level from HDDP_LOG_LEVEL (trace, debug,
// info, warn, error, off; default info). Logging never throws.
//
// spdlog does the work behind this header; callers only see these functions, so the
// public headers do not depend on spdlog or fmt (LibTorch bundles its own fmt).
//
//   HDDP_LOG_INFO("comm", "connected to ", peers, " peers");
#pragma once

#include <c10/util/StringUtil.h>

#include <functional>
#include <string>

namespace hddp {
namespace log {

enum class Level { Trace = 0, Debug, Info, Warn, Error, Off };

/// Parses "trace".."off" (case-insensitive); throws hddp::ConfigError otherwise.
Level parseLevel(const std::string& text);
const char* levelName(Level level) noexcept;

/// The process-wide threshold. Initialised from HDDP_LOG_LEVEL on first use.
Level level() noexcept;
void setLevel(Level level) noexcept;
bool enabled(Level level) noexcept;

/// Sets the rank shown in every line ("[rank 3]"); -1 hides it. Thread-safe.
void setRank(int rank) noexcept;
int rank() noexcept;
/// Whether the launcher already starts every line of this process's stderr with the
/// rank (hddp-run does, as "[rank 3] ", unless --no-prefix or on rank 0's terminal): the
/// lines written to stderr then leave it out, so that it appears once. A line handler
/// still gets it. initFromEnv() sets it from the launch (LaunchInfo::rankPrefixed).
/// Default false. Thread-safe.
void setLauncherPrefixesRank(bool prefixed) noexcept;

/// Writes one line to the logger "hddp.<layer>" (stderr). Never throws.
void write(const char* layer, Level level, const std::string& message) noexcept;

/// Receives each line that passes the level threshold, as "[rank 3] [hddp.comm] [info]
/// message" (no time stamp), instead of stderr. For tests, and for programs that route
/// hddp's log lines themselves. Called under a lock: it must not log.
using LineHandler = std::function<void(Level level, const std::string& line)>;
/// Installs `handler`; an empty one restores stderr. Thread-safe.
void setLineHandler(LineHandler handler);

namespace detail {
template <typename MakeMessage>
void writeNoThrow(const char* layer, Level lvl, MakeMessage&& make) noexcept {
  if (!enabled(lvl)) {
    return;
  }
  try {
    write(layer, lvl, make());
  } catch (...) {
    // Formatting failed (e.g. out of memory): dropping one log line is the right call.
  }
}
}  // namespace detail

}  // namespace log
}  // namespace hddp

#define HDDP_LOG(layer, lvl, ...) \
  ::hddp::log::detail::writeNoThrow(layer, lvl, [&] { return ::c10::str(__VA_ARGS__); })
#define HDDP_LOG_TRACE(layer, ...) HDDP_LOG(layer, ::hddp::log::Level::Trace, __VA_ARGS__)
#define HDDP_LOG_DEBUG(layer, ...) HDDP_LOG(layer, ::hddp::log::Level::Debug, __VA_ARGS__)
#define HDDP_LOG_INFO(layer, ...) HDDP_LOG(layer, ::hddp::log::Level::Info, __VA_ARGS__)
#define HDDP_LOG_WARN(layer, ...) HDDP_LOG(layer, ::hddp::log::Level::Warn, __VA_ARGS__)
#define HDDP_LOG_ERROR(layer, ...) HDDP_LOG(layer, ::hddp::log::Level::Error, __VA_ARGS__)
/// A message every rank computes identically (a new plan, the run's configuration):
/// rank 0 logs it at info, the other ranks only at debug, so a job's log says it once.
#define HDDP_LOG_SHARED(layer, rank, ...) \
  HDDP_LOG(layer, (rank) == 0 ? ::hddp::log::Level::Info : ::hddp::log::Level::Debug, __VA_ARGS__)
