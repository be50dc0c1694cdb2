#include "hddp/train/tensorboard.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "train/event_file.h"

namespace hddp {
namespace {

using Clock = std::chrono::steady_clock;

// Records reach the file at least this often while a run writes.
constexpr auto kFlushInterval = std::chrono::seconds(2);

double unixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string hostName() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') {
    return "localhost";
  }
  return name;
}

}  // namespace

class TensorBoardWriter::Impl {
 public:
  explicit Impl(const std::string& dir) {
    HDDP_CHECK_AS(ConfigError, !dir.empty(),
                  "TensorBoardWriter needs a folder to write its event file in");
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    HDDP_CHECK_AS(ConfigError, !ec, "cannot create the TensorBoard folder ", dir, ": ",
                  ec.message(), " (give a writable folder)");
    const auto seconds = static_cast<int64_t>(unixSeconds());
    const std::string suffix = "." + hostName() + "." + std::to_string(::getpid()) + ".hddp";
    for (int64_t later = 0; file_ == nullptr; ++later) {
      path_ = (std::filesystem::path(dir) /
               ("events.out.tfevents." + std::to_string(seconds + later) + suffix))
                  .string();
      file_ = std::fopen(path_.c_str(), "wbx");  // x: never overwrite another writer's file
      const int err = errno;
      HDDP_CHECK_AS(ConfigError, file_ != nullptr || (err == EEXIST && later < 10000),
                    "cannot create the TensorBoard event file ", path_, ": ", std::strerror(err),
                    " (give a writable folder)");
    }
    try {
      write(train::events::fileVersion(unixSeconds()));
      flush();
    } catch (...) {
      std::fclose(file_);
      throw;
    }
  }

  ~Impl() {
    if (std::fflush(file_) != 0) {
      HDDP_LOG_ERROR("train", "the last TensorBoard events could not be written to ", path_, ": ",
                     std::strerror(errno));
    }
    if (std::fclose(file_) != 0) {
      HDDP_LOG_ERROR("train", "closing the TensorBoard event file ", path_,
                     " failed: ", std::strerror(errno));
    }
  }

  void write(const std::string& event) {
    const std::string record = train::frameRecord(event);
    const bool written = std::fwrite(record.data(), 1, record.size(), file_) == record.size();
    const int err = errno;
    HDDP_CHECK(written, "cannot write the TensorBoard event file ", path_, ": ", std::strerror(err),
               " (is the disk full?)");
    if (Clock::now() - lastFlush_ > kFlushInterval) {
      flush();
    }
  }

  void flush() {
    const bool flushed = std::fflush(file_) == 0;
    const int err = errno;
    HDDP_CHECK(flushed, "cannot write the TensorBoard event file ", path_, ": ", std::strerror(err),
               " (is the disk full?)");
    lastFlush_ = Clock::now();
  }

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  Clock::time_point lastFlush_ = Clock::now();
};

TensorBoardWriter::TensorBoardWriter(const std::string& dir) : impl_(std::make_unique<Impl>(dir)) {}

TensorBoardWriter::~TensorBoardWriter() = default;
TensorBoardWriter::TensorBoardWriter(TensorBoardWriter&&) noexcept = default;
TensorBoardWriter& TensorBoardWriter::operator=(TensorBoardWriter&&) noexcept = default;

void TensorBoardWriter::addScalar(const std::string& tag, double value, int64_t step,
                                  std::optional<double> wallTime) {
  HDDP_CHECK(impl_ != nullptr, "TensorBoardWriter used after it was moved from");
  impl_->write(train::events::scalar(tag, static_cast<float>(value), step,
                                     wallTime ? *wallTime : unixSeconds()));
}

void TensorBoardWriter::addText(const std::string& tag, const std::string& text, int64_t step,
                                std::optional<double> wallTime) {
  HDDP_CHECK(impl_ != nullptr, "TensorBoardWriter used after it was moved from");
  impl_->write(train::events::text(tag, text, step, wallTime ? *wallTime : unixSeconds()));
}

void TensorBoardWriter::markStart(int64_t step, std::optional<double> wallTime) {
  HDDP_CHECK(impl_ != nullptr, "TensorBoardWriter used after it was moved from");
  impl_->write(train::events::sessionStart(step, wallTime ? *wallTime : unixSeconds()));
}

void TensorBoardWriter::flush() {
  HDDP_CHECK(impl_ != nullptr, "TensorBoardWriter used after it was moved from");
  impl_->flush();
}

const std::string& TensorBoardWriter::path() const {
  HDDP_CHECK(impl_ != nullptr, "TensorBoardWriter used after it was moved from");
  return impl_->path();
}

}  // namespace hddp
