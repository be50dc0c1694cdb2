#include "hddp_protocol/launch.h"

#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <functional>

namespace hddp {
namespace protocol {
namespace {

constexpr const char* kMarkPrefix = "progress.slot";

}  // namespace

std::string progressMarkPath(const std::string& dir, int slot) {
  return dir + "/" + kMarkPrefix + std::to_string(slot);
}

std::optional<int> progressMarkSlot(const std::string& fileName) {
  const std::string prefix = kMarkPrefix;
  if (fileName.rfind(prefix, 0) != 0 || fileName.size() == prefix.size() ||
      fileName.size() > prefix.size() + 6) {
    return std::nullopt;
  }
  for (size_t i = prefix.size(); i < fileName.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(fileName[i]))) {
      return std::nullopt;
    }
  }
  return std::stoi(fileName.substr(prefix.size()));
}

std::optional<ProgressMark> readProgressMark(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return std::nullopt;
  }
  int64_t value[2] = {0, -1};
  const bool whole = ::pread(fd, value, sizeof(value), 0) == sizeof(value);
  ::close(fd);
  if (!whole) {
    return std::nullopt;
  }
  return ProgressMark{value[0], value[1]};
}

void writeProgressMark(int fd, const ProgressMark& mark) {
  const int64_t value[2] = {mark.job, mark.step};
  (void)!::pwrite(fd, value, sizeof(value), 0);  // a hint for the log, no fsync
}

int64_t progressMarkJob() {
  const char* id = std::getenv(kEnvRunId);
  return static_cast<int64_t>(std::hash<std::string>{}(id ? id : ""));
}

}  // namespace protocol
}  // namespace hddp
