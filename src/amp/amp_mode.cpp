#include "hddp/amp/amp_mode.h"

#include "hddp/core/error.h"

namespace hddp {

AmpMode parseAmpMode(const std::string& text) {
  if (text == "off" || text == "none" || text == "fp32") {
    return AmpMode::Off;
  }
  if (text == "bf16" || text == "bfloat16") {
    return AmpMode::Bf16;
  }
  if (text == "fp16" || text == "float16" || text == "half") {
    return AmpMode::Fp16;
  }
  HDDP_THROW(ConfigError, "unknown mixed-precision mode '", text, "': use off, bf16 or fp16");
}

const char* ampModeName(AmpMode mode) noexcept {
  switch (mode) {
    case AmpMode::Off:
      return "off";
    case AmpMode::Bf16:
      return "bf16";
    case AmpMode::Fp16:
      return "fp16";
  }
  return "?";
}

}  // namespace hddp
