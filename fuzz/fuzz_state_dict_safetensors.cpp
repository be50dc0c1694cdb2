// hddp::readStateDict on a `.safetensors` file (src/train/state_dict.cpp): the 8-byte
// header length, the JSON header, each tensor's dtype, shape and byte range.
//
// Beyond the rule of fuzz_support.h: what it returns holds no more tensor bytes than the
// file (safetensors' tensors tile its data), so nothing was allocated beyond the input.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "hddp/train/state_dict.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = hddp::fuzz::writeInput(data, size, "input.safetensors");
  hddp::fuzz::refusedCleanly("readStateDict(.safetensors)", [&] {
    uint64_t bytes = 0;
    for (const auto& [key, tensor] : hddp::readStateDict(path)) {
      bytes += tensor.nbytes();
    }
    if (bytes > size) {
      hddp::fuzz::finding("readStateDict(.safetensors)", "unbounded",
                          "its tensors hold more bytes than the file");
    }
  });
  return 0;
}
