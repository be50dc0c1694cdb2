// hddp::readIdx (src/data/file_formats.cpp): the IDX files of MNIST and Fashion-MNIST,
// plain or gzip-compressed (an input that starts with gzip's magic bytes is read as
// "<name>.gz", through zlib, as Debian's Fashion-MNIST files are).
//
// Beyond the rule of fuzz_support.h: a plain file yields exactly its bytes after the
// header, so the tensor holds no more bytes than the input.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "hddp/data/datasets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const bool gz = size >= 2 && data[0] == 0x1f && data[1] == 0x8b;
  const std::string path = hddp::fuzz::writeInput(data, size, gz ? "input.idx.gz" : "input.idx");
  hddp::fuzz::refusedCleanly("readIdx", [&] {
    const at::Tensor t = hddp::readIdx(path);
    if (!gz && t.nbytes() > size) {
      hddp::fuzz::finding("readIdx", "unbounded", "the tensor holds more bytes than the file");
    }
  });
  return 0;
}
