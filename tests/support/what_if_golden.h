// The what-if golden case shared by the unit test (tests/balance/what_if_test.cpp, where
// its figures are worked out by hand) and the hddp-probe test
// (tests/tools/what_if_tool_test.cpp): two cards, two links and a model profile.
#pragma once

#include <string>

#include "hddp/balance/what_if.h"

namespace hddp {
namespace testing {

/// {"devices": {"fast", "slow"}, "links": {"wide", "narrow"}} in devices.json's format.
inline std::string goldenTableJson() {
  return R"({
    "devices": {
      "fast": {"name": "Fast", "fp32_tflops": 10, "fp16_tflops": 0, "bf16_tflops": 0,
               "memory_gib": 10, "memory_GBps": 100, "source": "test"},
      "slow": {"name": "Slow", "fp32_tflops": 5, "fp16_tflops": 20, "bf16_tflops": 0,
               "memory_gib": 3, "memory_GBps": 50, "source": "test"}},
    "links": {
      "wide":   {"name": "Wide", "GBps": 10, "source": "test"},
      "narrow": {"name": "Narrow", "GBps": 1, "source": "test"}}})";
}

inline ModelProfile goldenProfile() {
  ModelProfile p;
  p.model = "golden";
  p.trainFlopsPerSample = 2e9;
  p.parameterBytes = 1e8;
  p.inputBytesPerSample = 5e5;
  p.activationBytesPerSample = 32.0 * (1 << 20);
  return p;
}

}  // namespace testing
}  // namespace hddp
