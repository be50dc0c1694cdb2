#include "hddp/train/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <vector>

#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "train/event_file.h"

namespace hddp {
namespace {

using Clock = std::chrono::steady_clock;

// An add* call writes what is buffered once the last flush is older than this, or once
// this much is buffered.
constexpr auto kFlushInterval = std::chrono::seconds(2);
constexpr size_t kMaxPendingBytes = 64 << 10;

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

bool tensorBoardAvailable() noexcept { return true; }

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
    for (int64_t later = 0; fd_ < 0; ++later) {
      path_ = (std::filesystem::path(dir) /
               ("events.out.tfevents." + std::to_string(seconds + later) + suffix))
                  .string();
      // O_EXCL: never overwrite another writer's file.
      fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      const int err = errno;
      HDDP_CHECK_AS(ConfigError, fd_ >= 0 || (err == EEXIST && later < 10000),
                    "cannot create the TensorBoard event file ", path_, ": ", std::strerror(err),
                    " (give a writable folder)");
    }
    try {
      pending_ = train::frameRecord(train::events::fileVersion(unixSeconds()));
      recordEnds_.push_back(pending_.size());
      HDDP_CHECK_AS(ConfigError, writePending(), failure_);
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }

  ~Impl() {
    try {
      if (!failed_ && !pending_.empty() && !writePending()) {
        HDDP_LOG_ERROR("train", "closing: ", failure_);
      }
    } catch (...) {
      // Out of memory while saying why: the file is closed all the same.
    }
    if (::close(fd_) != 0) {
      HDDP_LOG_ERROR("train", "closing the TensorBoard event file ", path_,
                     " failed: ", std::strerror(errno));
    }
  }

  void add(const std::string& event) {
    checkNotFailed();
    pending_ += train::frameRecord(event);
    recordEnds_.push_back(pending_.size());
    if (pending_.size() >= kMaxPendingBytes || Clock::now() - lastFlush_ > kFlushInterval) {
      flush();
    }
  }

  void flush() {
    checkNotFailed();
    HDDP_CHECK(writePending(), failure_);
  }

  bool failed() const { return failed_; }
  const std::string& path() const { return path_; }

 private:
  // Writes pending_ to the file. On a failure the file is cut back to its last whole
  // record (a reader stops at a torn one; best effort: the disk is failing anyway), the
  // writer is failed (failure_ says why) and false returned.
  bool writePending() {
    size_t done = 0;
    int err = 0;
    while (done < pending_.size()) {
      const ssize_t n = ::write(fd_, pending_.data() + done, pending_.size() - done);
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n <= 0) {
        err = n < 0 ? errno : EIO;
        break;
      }
      done += static_cast<size_t>(n);
    }
    if (err == 0) {
      fileBytes_ += pending_.size();
      pending_.clear();
      recordEnds_.clear();
      lastFlush_ = Clock::now();
      return true;
    }
    failed_ = true;
    size_t whole = 0;
    for (size_t end : recordEnds_) {
      if (end <= done) {
        whole = end;
      }
    }
    const bool cut = whole == done || ::ftruncate(fd_, static_cast<off_t>(fileBytes_ + whole)) == 0;
    const auto lost = std::count_if(recordEnds_.begin(), recordEnds_.end(),
                                    [&](size_t end) { return end > whole; });
    failure_ =
        c10::str("cannot write the TensorBoard event file ", path_, ": ", std::strerror(err),
                 " (is the disk full?); ", lost, " of the ", recordEnds_.size(),
                 " records since the last flush are lost", cut ? "" : ", and the last one is torn");
    pending_.clear();
    recordEnds_.clear();
    return false;
  }

  void checkNotFailed() const {
    HDDP_CHECK(!failed_, "the TensorBoard event file ", path_,
               " takes no more records: an earlier write failed (", failure_, ")");
  }

  std::string path_;
  int fd_ = -1;
  std::string pending_;             // whole records not yet written
  std::vector<size_t> recordEnds_;  // where each record of pending_ ends
  uint64_t fileBytes_ = 0;          // bytes in the file, all whole records
  Clock::time_point lastFlush_ = Clock::now();
  bool failed_ = false;
  std::string failure_;  // why, once failed_
};

TensorBoardWriter::TensorBoardWriter(const std::string& dir) : impl_(std::make_unique<Impl>(dir)) {}

TensorBoardWriter::~TensorBoardWriter() = default;
TensorBoardWriter::TensorBoardWriter(TensorBoardWriter&&) noexcept = default;
TensorBoardWriter& TensorBoardWriter::operator=(TensorBoardWriter&&) noexcept = default;

void TensorBoardWriter::addScalar(const std::string& tag, double value, int64_t step,
                                  std::optional<double> wallTime) {
  HDDP_CHECK(impl_ != nullptr, "TensorBoardWriter used after it was moved from");
  impl_->add(train::events::scalar(tag, static_cast<float>(value), step,
                                   wallTime ? *wallTime : unixSeconds()));
}

void TensorBoardWriter::addText(const std::string& tag, const std::string& text, int64_t step,
                                std::optional<double> wallTime) {
  HDDP_CHECK(impl_ != nullptr, "TensorBoardWriter used after it was moved from");
  impl_->add(train::events::text(tag, text, step, wallTime ? *wallTime : unixSeconds()));
}

void TensorBoardWriter::markStart(int64_t step, std::optional<double> wallTime) {
  HDDP_CHECK(impl_ != nullptr, "TensorBoardWriter used after it was moved from");
  impl_->add(train::events::sessionStart(step, wallTime ? *wallTime : unixSeconds()));
}

void TensorBoardWriter::flush() {
  HDDP_CHECK(impl_ != nullptr, "TensorBoardWriter used after it was moved from");
  impl_->flush();
}

bool TensorBoardWriter::failed() const {
  HDDP_CHECK(impl_ != nullptr, "TensorBoardWriter used after it was moved from");
  return impl_->failed();
}

const std::string& TensorBoardWriter::path() const {
  HDDP_CHECK(impl_ != nullptr, "TensorBoardWriter used after it was moved from");
  return impl_->path();
}

}  // namespace hddp
