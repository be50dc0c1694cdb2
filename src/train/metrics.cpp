#include "train/metrics.h"

#include <filesystem>

#include "hddp/core/error.h"
#include "hddp/core/live_line.h"

namespace hddp {
namespace train {

std::string metricsPathForRank(const std::string& path, int rank) {
  if (rank == 0 || path.empty()) {
    return path;
  }
  std::filesystem::path p(path);
  const std::string tag = ".rank" + std::to_string(rank);
  return (p.parent_path() / (p.stem().string() + tag + p.extension().string())).string();
}

MetricsWriter::MetricsWriter(const std::string& path, bool append) : path_(path) {
  if (path.empty()) {
    return;
  }
  std::filesystem::path p(path);
  std::error_code ec;
  if (p.has_parent_path()) {
    std::filesystem::create_directories(p.parent_path(), ec);
  }
  out_.open(path, append ? std::ios::app : std::ios::trunc);
  HDDP_CHECK(out_.is_open(), "cannot open the metrics file ", path);
}

void MetricsWriter::write(const nlohmann::json& record) {
  if (!out_.is_open()) {
    return;
  }
  out_ << record.dump() << '\n';
  out_.flush();
}

Progress::Progress(bool enabled, bool live, int64_t every)
    : enabled_(enabled), live_(live), every_(std::max<int64_t>(1, every)) {}

void Progress::step(int64_t epoch, int64_t epochs, int64_t stepInEpoch, int64_t stepsPerEpoch,
                    double loss, double samplesPerSecond, const std::string& extra) {
  if (!enabled_) {
    return;
  }
  const int64_t done = stepInEpoch + 1;
  if (live_) {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_ < std::chrono::milliseconds(100) && done != stepsPerEpoch) {
      return;
    }
    last_ = now;
    constexpr int kWidth = 24;
    const int filled = stepsPerEpoch > 0 ? static_cast<int>(kWidth * done / stepsPerEpoch) : 0;
    std::string bar(static_cast<size_t>(std::min(filled, kWidth)), '#');
    bar.resize(kWidth, '.');
    std::fprintf(stderr, "\r\033[Kepoch %lld/%lld [%s] %lld/%lld  loss %.4f  %.0f samples/s%s",
                 static_cast<long long>(epoch + 1), static_cast<long long>(epochs), bar.c_str(),
                 static_cast<long long>(done), static_cast<long long>(stepsPerEpoch), loss,
                 samplesPerSecond, extra.c_str());
    std::fflush(stderr);
    log::setLiveLineOpen(true);
    return;
  }
  if (done % every_ == 0 || done == stepsPerEpoch) {
    std::fprintf(stderr, "epoch %lld/%lld step %lld/%lld  loss %.4f  %.0f samples/s%s\n",
                 static_cast<long long>(epoch + 1), static_cast<long long>(epochs),
                 static_cast<long long>(done), static_cast<long long>(stepsPerEpoch), loss,
                 samplesPerSecond, extra.c_str());
    std::fflush(stderr);
  }
}

void Progress::line(const std::string& text) {
  if (!enabled_) {
    return;
  }
  log::closeLiveLine(/*clear=*/false);
  std::fprintf(stderr, "%s\n", text.c_str());
  std::fflush(stderr);
}

}  // namespace train
}  // namespace hddp
