// The mixed-precision modes of the training loop, and their names on command lines.
#pragma once

#include <string>

namespace hddp {

enum class AmpMode {
  Off,
  /// bfloat16 autocast (CPU and CUDA); no loss scaling needed.
  Bf16,
  /// float16 autocast (CUDA) with dynamic loss scaling (GradScaler).
  Fp16,
};
/// "off", "bf16", "fp16" (also "none"/"fp32", "bfloat16", "float16"/"half"); throws
/// hddp::ConfigError otherwise.
AmpMode parseAmpMode(const std::string& text);
const char* ampModeName(AmpMode mode) noexcept;

}  // namespace hddp
