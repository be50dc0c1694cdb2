// Metrics as JSON lines, and rank 0's progress output (internal to the train layer).
#pragma once

#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace hddp {
namespace train {

/// "run/metrics.jsonl" for rank 0, "run/metrics.rank1.jsonl" for rank 1.
std::string metricsPathForRank(const std::string& path, int rank);

class MetricsWriter {
 public:
  MetricsWriter() = default;
  /// Appends when `append` (a resumed run continues its file), else truncates.
  MetricsWriter(const std::string& path, bool append);
  bool enabled() const { return out_.is_open(); }
  void write(const nlohmann::json& record);

 private:
  std::ofstream out_;
  std::string path_;
};

/// Rank 0's progress: a live bar on a terminal (at most 10 updates per second), plain
/// lines every `every` steps otherwise.
class Progress {
 public:
  Progress(bool enabled, bool live, int64_t every);
  void step(int64_t epoch, int64_t epochs, int64_t stepInEpoch, int64_t stepsPerEpoch, double loss,
            double samplesPerSecond, const std::string& extra);
  /// Ends the bar's line and prints `line`.
  void line(const std::string& text);

 private:
  bool enabled_;
  bool live_;
  int64_t every_;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace train
}  // namespace hddp
