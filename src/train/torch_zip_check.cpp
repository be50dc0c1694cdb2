// A torch.save file's or a LibTorch archive's zip entries checked against its size
// (train/torch_pickle.h), before LibTorch's zip reader (caffe2::serialize::PyTorchStreamReader over
// miniz) allocates each entry at the size its directory claims: the reader's constructor already
// reads the "version" entry that way, before hddp sees a name. Only the directory is read here
// (APPNOTE.TXT 4.3.12-4.3.16, with zip64's records and extra field for large files);
// miniz still checks the rest.
#include <cstdint>

#include "hddp/core/error.h"
#include "train/torch_pickle.h"

namespace hddp {
namespace train {

namespace {

constexpr uint64_t kEndOfDirectory = 0x06054b50;
constexpr uint64_t kZip64Locator = 0x07064b50;
constexpr uint64_t kZip64EndOfDirectory = 0x06064b50;
constexpr uint64_t kDirectoryEntry = 0x02014b50;
constexpr uint64_t kMax32 = 0xffffffff;

// A little-endian field of `n` bytes at `at`; the caller has checked it lies in `b`.
uint64_t field(const std::string& b, uint64_t at, int n) {
  uint64_t v = 0;
  for (int k = n - 1; k >= 0; --k) {
    v = (v << 8) | static_cast<unsigned char>(b[static_cast<size_t>(at) + static_cast<size_t>(k)]);
  }
  return v;
}

}  // namespace

void checkZipEntrySizes(const std::string& bytes, const std::string& what) {
  const uint64_t size = bytes.size();
  // The end-of-directory record: 22 bytes and a comment of up to 65535, at the very end.
  uint64_t end = size;
  if (size >= 22) {
    const uint64_t lowest = size > 22 + 65535 ? size - 22 - 65535 : 0;
    for (uint64_t at = size - 22 + 1; at-- > lowest;) {
      if (field(bytes, at, 4) == kEndOfDirectory) {
        end = at;
        break;
      }
    }
  }
  HDDP_CHECK_AS(StateError, end < size, what,
                " holds no readable archive: it does not end with a zip directory (torch.save "
                "and LibTorch write zip files)");
  uint64_t dirSize = field(bytes, end + 12, 4);
  uint64_t dirOffset = field(bytes, end + 16, 4);
  if (end >= 20 && field(bytes, end - 20, 4) == kZip64Locator) {
    const uint64_t at = field(bytes, end - 20 + 8, 8);
    HDDP_CHECK_AS(StateError,
                  size >= 56 && at <= size - 56 && field(bytes, at, 4) == kZip64EndOfDirectory,
                  what, ": its zip64 directory record (at byte ", at, ") lies outside the file's ",
                  size, " bytes");
    dirSize = field(bytes, at + 40, 8);
    dirOffset = field(bytes, at + 48, 8);
  }
  HDDP_CHECK_AS(StateError, dirOffset <= size && dirSize <= size - dirOffset, what,
                ": its zip directory (", dirSize, " bytes at byte ", dirOffset,
                ") lies outside the file's ", size, " bytes");
  const uint64_t dirEnd = dirOffset + dirSize;
  for (uint64_t at = dirOffset; at < dirEnd;) {
    HDDP_CHECK_AS(StateError, dirEnd - at >= 46 && field(bytes, at, 4) == kDirectoryEntry, what,
                  ": its zip directory is malformed at byte ", at);
    uint64_t compressed = field(bytes, at + 20, 4);
    uint64_t uncompressed = field(bytes, at + 24, 4);
    const uint64_t nameEnd = at + 46 + field(bytes, at + 28, 2);
    const uint64_t extraEnd = nameEnd + field(bytes, at + 30, 2);
    const uint64_t next = extraEnd + field(bytes, at + 32, 2);
    HDDP_CHECK_AS(StateError, next <= dirEnd, what, ": its zip directory is malformed at byte ",
                  at);
    // zip64 sizes: extra field 1 holds the uncompressed, then the compressed size, each
    // only where the 32-bit field above is all ones.
    for (uint64_t e = nameEnd; extraEnd - e >= 4;) {
      const uint64_t id = field(bytes, e, 2);
      const uint64_t dataEnd = e + 4 + field(bytes, e + 2, 2);
      if (dataEnd > extraEnd) {
        break;
      }
      uint64_t f = e + 4;
      if (id == 1 && uncompressed == kMax32 && dataEnd - f >= 8) {
        uncompressed = field(bytes, f, 8);
        f += 8;
      }
      if (id == 1 && compressed == kMax32 && dataEnd - f >= 8) {
        compressed = field(bytes, f, 8);
      }
      e = dataEnd;
    }
    const std::string name =
        bytes.substr(static_cast<size_t>(at + 46), static_cast<size_t>(nameEnd - at - 46));
    HDDP_CHECK_AS(StateError, uncompressed <= size && compressed <= size, what, ": its zip entry ",
                  name, " claims ", uncompressed, " bytes (", compressed,
                  " stored), more than the whole file's ", size,
                  ". torch.save and LibTorch store their data uncompressed: the file is damaged "
                  "or written by another program");
    at = next;
  }
}

}  // namespace train
}  // namespace hddp
