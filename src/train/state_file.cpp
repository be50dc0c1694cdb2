#include "hddp/train/state_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "hddp/core/error.h"
#include "hddp/core/fault.h"
#include "hddp/core/logging.h"
#include "train/state_file_seam.h"

namespace fs = std::filesystem;

namespace hddp {
namespace {

constexpr char kMagic[8] = {'H', 'D', 'D', 'P', 'S', 'T', '0', '1'};
constexpr size_t kHeader = 8 + 8 + 4;

std::array<uint32_t, 256> makeCrcTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) {
      c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    }
    table[i] = c;
  }
  return table;
}

void writeAll(int fd, const char* data, size_t size, const std::string& path) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    HDDP_CHECK_AS(StateError, n > 0, "cannot write ", path, ": ", std::strerror(errno),
                  " (disk full? the previous state files are untouched)");
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void fsyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

std::atomic<detail::StateWriteHook> gWriteHook{nullptr};

bool parseStep(const std::string& name, const std::string& prefix, int64_t* step) {
  const std::string suffix = ".hddp";
  if (name.size() <= prefix.size() + suffix.size() || name.compare(0, prefix.size(), prefix) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  const std::string digits =
      name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) {
    return false;
  }
  HDDP_CHECK_AS(ConfigError, digits.size() <= 18, "state file '", name, "' has a step number of ",
                digits.size(),
                " digits, beyond what hddp writes (at most 18); rename or remove it");
  *step = std::stoll(digits);
  return true;
}

}  // namespace

void detail::setStateWriteHook(StateWriteHook hook) noexcept { gWriteHook.store(hook); }

uint32_t crc32Of(const void* data, size_t size) {
  static const std::array<uint32_t, 256> table = makeCrcTable();
  uint32_t c = 0xFFFFFFFFu;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < size; ++i) {
    c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  }
  return c ^ 0xFFFFFFFFu;
}

void writeStateFile(const std::string& path, const std::string& payload) {
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  fs::create_directories(dir, ec);
  HDDP_CHECK_AS(StateError, !ec, "cannot create the state directory ", dir.string(), ": ",
                ec.message());
  std::string header(kHeader, '\0');
  std::memcpy(&header[0], kMagic, 8);
  const uint64_t length = payload.size();
  const uint32_t crc = crc32Of(payload.data(), payload.size());
  for (int i = 0; i < 8; ++i) {
    header[8 + i] = static_cast<char>((length >> (8 * i)) & 0xFF);
  }
  for (int i = 0; i < 4; ++i) {
    header[16 + i] = static_cast<char>((crc >> (8 * i)) & 0xFF);
  }
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  HDDP_CHECK_AS(StateError, fd >= 0, "cannot create ", tmp, ": ", std::strerror(errno));
  try {
    writeAll(fd, header.data(), header.size(), tmp);
    fault::beforeSave(path);  // HDDP_FAULT's save=N: a full disk, after the header
    if (const auto hook = gWriteHook.load()) {
      hook(fd, tmp, payload);
    }
    writeAll(fd, payload.data(), payload.size(), tmp);
    HDDP_CHECK_AS(StateError, ::fsync(fd) == 0, "fsync of ", tmp,
                  " failed: ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  HDDP_CHECK_AS(StateError, ::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename ", tmp, " to ",
                path, ": ", std::strerror(errno));
  fsyncDirectory(dir.string());
}

std::string readStateFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  HDDP_CHECK_AS(StateError, in.good(), "cannot open state file ", path,
                " (does it exist? a directory given to --resume is searched for the newest)");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  HDDP_CHECK_AS(StateError, bytes.size() >= kHeader && std::memcmp(bytes.data(), kMagic, 8) == 0,
                "'", path, "' is not an hddp state file (bad magic number)");
  uint64_t length = 0;
  uint32_t crc = 0;
  for (int i = 0; i < 8; ++i) {
    length |= uint64_t(static_cast<uint8_t>(bytes[8 + i])) << (8 * i);
  }
  for (int i = 0; i < 4; ++i) {
    crc |= uint32_t(static_cast<uint8_t>(bytes[16 + i])) << (8 * i);
  }
  HDDP_CHECK_AS(StateError, bytes.size() - kHeader == length, "state file ", path,
                " is truncated or corrupt: its header announces ", length,
                " bytes of data, it has ", bytes.size() - kHeader,
                ". Resume from an earlier state file in the same directory.");
  const uint32_t actual = crc32Of(bytes.data() + kHeader, length);
  HDDP_CHECK_AS(StateError, actual == crc, "state file ", path,
                " is corrupt: checksum mismatch (stored ", crc, ", computed ", actual,
                "). Resume from an earlier state file in the same directory.");
  return bytes.substr(kHeader);
}

std::vector<std::string> listStateFiles(const std::string& dir, const std::string& prefix) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return {};
  }
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    int64_t step = 0;
    if (entry.is_regular_file() && parseStep(entry.path().filename().string(), prefix, &step)) {
      found.emplace_back(step, entry.path().string());
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) {
    out.push_back(std::move(f.second));
  }
  return out;
}

void pruneStateFiles(const std::string& dir, int keep, const std::string& prefix) {
  auto files = listStateFiles(dir, prefix);
  std::error_code ec;
  for (size_t i = 0; keep > 0 && files.size() > static_cast<size_t>(keep) &&
                     i < files.size() - static_cast<size_t>(keep);
       ++i) {
    fs::remove(files[i], ec);
  }
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.compare(0, prefix.size(), prefix) == 0 && entry.path().extension() == ".tmp") {
      HDDP_LOG_WARN("train", "removing ", entry.path().string(), ", left by an interrupted save");
      fs::remove(entry.path(), ec);
    }
  }
}

std::string stateFileName(const std::string& dir, int64_t step, const std::string& prefix) {
  char digits[32];
  std::snprintf(digits, sizeof(digits), "%08lld", static_cast<long long>(step));
  return (fs::path(dir) / (prefix + digits + ".hddp")).string();
}

}  // namespace hddp
