// The pickle machine alone (hddp::train::unpickle, src/train/pickle_reader.cpp): the
// data.pkl of a torch.save file, fed straight in, so that the fuzzer's mutations reach
// the opcodes without going through the zip around them (fuzz_state_dict_pt does that).
// Lengths against the bytes left, nesting depth, memo references, no cycles, and a
// destructor that does not recurse: any input returns a value or a StateError.
#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "train/pickle_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string pickle(reinterpret_cast<const char*>(data), size);
  hddp::fuzz::refusedCleanly("unpickle", [&] {
    const hddp::train::PickleValuePtr root = hddp::train::unpickle(pickle, "fuzz/data.pkl");
    if (!root || root->depth > hddp::train::kMaxPickleDepth) {
      hddp::fuzz::finding("unpickle", "contract", "a null value or one nested too deep");
    }
  });
  return 0;
}
