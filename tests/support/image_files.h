// Files for the image decoders' tests (tests/data/image_*_test.cpp): where the committed
// images are, reading and writing whole files, and the message of a DataError.
#pragma once

#include <fstream>
#include <sstream>
#include <string>

#include "hddp/core/error.h"

namespace hddp {
namespace testing {

/// `relative` under tests/ in the source tree (tests/data/images/..., ../fuzz/...).
inline std::string sourcePath(const std::string& relative) {
  return std::string(HDDP_TEST_SOURCE_DIR) + "/" + relative;
}

inline std::string fileContents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

inline void writeFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

/// The message of the hddp::DataError `fn` throws, or "(no DataError)".
template <typename Fn>
std::string dataErrorOf(Fn&& fn) {
  try {
    fn();
  } catch (const hddp::DataError& e) {
    return e.what_without_backtrace();
  }
  return "(no DataError)";
}

}  // namespace testing
}  // namespace hddp
