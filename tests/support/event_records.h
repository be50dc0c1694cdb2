// Reading TensorBoard event files back in tests: the TFRecord framing (by its lengths
// alone, or with both CRCs checked) and the protobuf wire format by hand, enough for an
// Event's fields and its Summary values (scalars and text).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "train/event_file.h"

namespace hddp {
namespace testing {
namespace event_records {

struct Field {
  uint64_t number = 0;
  int wire = 0;
  uint64_t value = 0;  // varint, fixed64 or fixed32
  std::string bytes;   // length-delimited
};

// The bytes as lowercase hex digits, two a byte.
inline std::string hex(const std::string& bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

inline uint64_t littleEndian(const std::string& bytes, size_t at, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) {
    v = (v << 8) | static_cast<unsigned char>(bytes.at(at + static_cast<size_t>(i)));
  }
  return v;
}

inline uint64_t varint(const std::string& s, size_t& at) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    const auto b = static_cast<unsigned char>(s.at(at++));
    v |= static_cast<uint64_t>(b & 0x7F) << shift;
    if ((b & 0x80) == 0) {
      return v;
    }
  }
  ADD_FAILURE() << "varint too long";
  return v;
}

inline std::vector<Field> fields(const std::string& message) {
  std::vector<Field> out;
  size_t at = 0;
  while (at < message.size()) {
    Field f;
    const uint64_t key = varint(message, at);
    f.number = key >> 3;
    f.wire = static_cast<int>(key & 7);
    if (f.wire == 0) {
      f.value = varint(message, at);
    } else if (f.wire == 1 || f.wire == 5) {
      const int n = f.wire == 1 ? 8 : 4;
      f.value = littleEndian(message, at, n);
      at += static_cast<size_t>(n);
    } else if (f.wire == 2) {
      const uint64_t n = varint(message, at);
      f.bytes = message.substr(at, n);
      EXPECT_EQ(f.bytes.size(), n) << "truncated field " << f.number;
      at += n;
    } else {
      ADD_FAILURE() << "unexpected wire type " << f.wire;
      return out;
    }
    out.push_back(f);
  }
  return out;
}

// The first field `number` of `message`; an empty Field when there is none.
inline Field firstField(const std::string& message, uint64_t number) {
  for (const Field& f : fields(message)) {
    if (f.number == number) {
      return f;
    }
  }
  return Field{};
}

// The one field `number` of `message` (a failure when absent or repeated).
inline Field field(const std::string& message, uint64_t number) {
  std::vector<Field> found;
  for (const Field& f : fields(message)) {
    if (f.number == number) {
      found.push_back(f);
    }
  }
  EXPECT_EQ(found.size(), 1u) << "field " << number << " in " << hex(message);
  return found.empty() ? Field{} : found.front();
}

inline bool hasField(const std::string& message, uint64_t number) {
  for (const Field& f : fields(message)) {
    if (f.number == number) {
      return true;
    }
  }
  return false;
}

// A fixed64 field's bits as the double they hold.
inline double asDouble(uint64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

// A fixed32 field's bits as the float they hold.
inline float asFloat(uint64_t bits) {
  const auto b = static_cast<uint32_t>(bits);
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// The names of the files in `dir`, sorted (the order TensorBoard reads event files in).
inline std::vector<std::string> eventFiles(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// A TFRecord file's records (length, its CRC, data, its CRC), by the lengths alone.
inline std::vector<std::string> records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string file = buffer.str();
  std::vector<std::string> out;
  size_t at = 0;
  while (at + 12 <= file.size()) {
    const uint64_t length = littleEndian(file, at, 8);
    if (at + 16 + length > file.size()) {
      ADD_FAILURE() << "a truncated record at byte " << at << " of " << path;
      break;
    }
    out.push_back(file.substr(at + 12, length));
    at += 16 + length;
  }
  return out;
}

// A TFRecord file's records, checking each length and both CRCs (a failure for each
// that is wrong, and for a torn record at the end). The CRC is hddp's own (checked
// against published vectors in tests/train/tensorboard_test.cpp), so this needs an
// hddp built with TensorBoard support (HDDP_TEST_TENSORBOARD).
inline std::vector<std::string> checkedRecords(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string file = buffer.str();
  std::vector<std::string> records;
  size_t at = 0;
  while (at < file.size()) {
    EXPECT_LE(at + 12, file.size()) << "a truncated header at byte " << at;
    if (at + 12 > file.size()) {
      break;
    }
    const uint64_t length = littleEndian(file, at, 8);
    EXPECT_EQ(littleEndian(file, at + 8, 4), hddp::train::maskedCrc32c(file.data() + at, 8))
        << "the length's CRC at byte " << at;
    EXPECT_LE(at + 16 + length, file.size()) << "a truncated record at byte " << at;
    if (at + 16 + length > file.size()) {
      break;
    }
    const std::string data = file.substr(at + 12, length);
    EXPECT_EQ(littleEndian(file, at + 12 + length, 4),
              hddp::train::maskedCrc32c(data.data(), data.size()))
        << "the data's CRC at byte " << at;
    records.push_back(data);
    at += 16 + length;
  }
  return records;
}

// Every Summary value of tag `tag` in the event files of `dir` (sorted by name), with
// its Event's step: (step, Value message).
inline std::vector<std::pair<int64_t, std::string>> valuesIn(const std::string& dir,
                                                             const std::string& tag) {
  std::vector<std::pair<int64_t, std::string>> out;
  for (const std::string& name : eventFiles(dir)) {
    for (const std::string& e : records(dir + "/" + name)) {
      // Event: step 2, summary 5 {value 1 {tag 1, simple_value 2, tensor 8}}.
      const std::string summary = firstField(e, 5).bytes;
      for (const Field& v : fields(summary)) {
        if (v.number == 1 && firstField(v.bytes, 1).bytes == tag) {
          out.emplace_back(static_cast<int64_t>(firstField(e, 2).value), v.bytes);
        }
      }
    }
  }
  return out;
}

// The text values of `tag` (a TensorProto's first string_val), as (step, text).
inline std::vector<std::pair<int64_t, std::string>> textsIn(const std::string& dir,
                                                            const std::string& tag) {
  std::vector<std::pair<int64_t, std::string>> out;
  for (const auto& [step, value] : valuesIn(dir, tag)) {
    out.emplace_back(step, firstField(firstField(value, 8).bytes, 8).bytes);
  }
  return out;
}

// The scalar values of `tag` (simple_value), as (step, value).
inline std::vector<std::pair<int64_t, float>> scalarValuesIn(const std::string& dir,
                                                             const std::string& tag) {
  std::vector<std::pair<int64_t, float>> out;
  for (const auto& [step, value] : valuesIn(dir, tag)) {
    const auto bits = static_cast<uint32_t>(firstField(value, 2).value);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    out.emplace_back(step, f);
  }
  return out;
}

}  // namespace event_records
}  // namespace testing
}  // namespace hddp
