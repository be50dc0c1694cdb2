// hddp::readStateDict on a torch.save file (`.pt`): the zip directory check
// (src/train/torch_zip_check.cpp), LibTorch's zip reader behind it, the pickle machine
// (pickle_reader.cpp) and each storage and tensor view (torch_pickle.cpp).
//
// Beyond the rule of fuzz_support.h: the storages it returns (distinct ones: tensors may
// share one) hold no more bytes than the file, so nothing was allocated beyond the input.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <set>
#include <string>

#include "fuzz_support.h"
#include "hddp/train/state_dict.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = hddp::fuzz::writeInput(data, size, "input.pt");
  hddp::fuzz::refusedCleanly("readStateDict(.pt)", [&] {
    std::set<const void*> storages;
    uint64_t bytes = 0;
    for (const auto& [key, tensor] : hddp::readStateDict(path)) {
      const auto& storage = tensor.storage();
      if (storages.insert(storage.data()).second) {
        bytes += storage.nbytes();
      }
    }
    if (bytes > size) {
      hddp::fuzz::finding("readStateDict(.pt)", "unbounded",
                          "its storages hold more bytes than the file");
    }
  });
  return 0;
}
