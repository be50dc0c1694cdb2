// A model profile (src/balance/model_profile_json.cpp): the JSON file hddp-probe
// --profile writes and --what-if --profile reads back, parsed by
// hddp::ModelProfile::fromJson. Beyond the rule of fuzz_support.h: what it accepts
// survives a round trip through toJson() unchanged.
#include <cstdint>
#include <string>

#include "fuzz_support.h"
#include "hddp/balance/what_if.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  hddp::fuzz::refusedCleanly("ModelProfile::fromJson", [&] {
    const hddp::ModelProfile p = hddp::ModelProfile::fromJson(text, "fuzz/profile.json");
    const std::string again = p.toJson();
    const hddp::ModelProfile q = hddp::ModelProfile::fromJson(again, "fuzz/round-trip.json");
    if (q.toJson() != again || q.gradientShapes != p.gradientShapes) {
      hddp::fuzz::finding("ModelProfile", "round trip", "toJson() then fromJson() changed it");
    }
  });
  return 0;
}
