// hddp's log lines captured for a scope (through log::setLineHandler, at `level` or
// above), for tests that check what a user is told.
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include "hddp/core/logging.h"

namespace hddp {
namespace testing {

class LogCapture {
 public:
  explicit LogCapture(log::Level level = log::Level::Info) : previous_(log::level()) {
    log::setLevel(level);
    log::setLineHandler([this](log::Level lvl, const std::string& line) {
      std::lock_guard<std::mutex> lock(mu_);
      lines_.emplace_back(lvl, line);
    });
  }
  ~LogCapture() {
    log::setLineHandler(nullptr);
    log::setLevel(previous_);
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;

  /// The captured lines of exactly `level` that contain `text`.
  std::vector<std::string> lines(log::Level level, const std::string& text) const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> out;
    for (const auto& [lvl, line] : lines_) {
      if (lvl == level && line.find(text) != std::string::npos) {
        out.push_back(line);
      }
    }
    return out;
  }

 private:
  log::Level previous_;
  mutable std::mutex mu_;
  std::vector<std::pair<log::Level, std::string>> lines_;
};

}  // namespace testing
}  // namespace hddp
