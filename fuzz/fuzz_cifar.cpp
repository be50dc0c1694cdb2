// hddp::loadCifar10 (src/data/file_formats.cpp) on the test split: the input is
// test_batch.bin, CIFAR-10's binary records (a label byte, then 3x32x32 pixels).
//
// Beyond the rule of fuzz_support.h: the dataset has one sample per whole record.
#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "hddp/data/datasets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  hddp::fuzz::writeInput(data, size, "test_batch.bin");
  hddp::fuzz::refusedCleanly("loadCifar10", [&] {
    const auto dataset = hddp::loadCifar10(hddp::fuzz::scratchDir(), hddp::Split::Test);
    if (dataset->size() * (1 + 3 * 32 * 32) != static_cast<int64_t>(size)) {
      hddp::fuzz::finding("loadCifar10", "contract", "samples that are not the file's records");
    }
  });
  return 0;
}
