// The disk in tests: removing a test's folder tree, and a full disk for a scope.
#pragma once

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>
#include <cstdlib>
#include <string>

namespace hddp {
namespace testing {

// Removes `dir` and everything under it (a failure when it cannot). Not
// std::filesystem::remove_all: in a process linked with the torch wheel's libtorch.so
// that call resolves into libtorch's copy and crashes (a null call).
inline void removeTree(const std::string& dir) {
  ASSERT_EQ(std::system(("rm -rf '" + dir + "'").c_str()), 0) << dir;
}

// A full disk for this process while in scope: files grow to `bytes` at most
// (RLIMIT_FSIZE), and a write past that fails with EFBIG instead of raising SIGXFSZ.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) : oldHandler_(std::signal(SIGXFSZ, SIG_IGN)) {
    EXPECT_EQ(::getrlimit(RLIMIT_FSIZE, &old_), 0);
    struct rlimit small = old_;
    small.rlim_cur = bytes;
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, oldHandler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  struct rlimit old_ {};
  void (*oldHandler_)(int);
};

}  // namespace testing
}  // namespace hddp
