// What-if's memory rules: footprints and ZeRO shares (what_if_memory.h).
#include "what_if_memory.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "hddp/balance/compression_model.h"
#include "hddp/core/error.h"

namespace hddp {
namespace what_if_detail {
namespace {

std::string gib(double bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f", bytes / kGiB);
  return text;
}

}  // namespace

Footprint footprint(const ModelProfile& p, const WhatIfSettings& s, double share) {
  Footprint f;
  f.parameters = p.parameterBytes;
  f.gradients = p.parameterBytes * (s.zero >= 2 ? share : 1.0);
  f.state = p.parameterBytes * s.optimizerStateCopies * (s.zero >= 1 ? share : 1.0);
  return f;
}

MemoryEstimator::Fit memoryFit(const DeviceSpec& d, const ModelProfile& p, const WhatIfSettings& s,
                               double share) {
  MemoryEstimator::Fit fit;
  fit.steps = 1;
  fit.fixedBytes = footprint(p, s, share).fixed();
  fit.perSampleBytes = p.activationBytesPerSample;
  fit.totalBytes = d.memoryGiB * kGiB;
  fit.otherBytes = s.contextBytes;
  return fit;
}

ShardRule parseShardRule(const std::string& text) {
  ShardRule rule;
  if (text == "memory") {
    return rule;
  }
  if (text == "equal") {
    rule.kind = ShardRule::Kind::Equal;
    return rule;
  }
  rule.kind = ShardRule::Kind::Ratios;
  std::stringstream in(text);
  std::string item;
  double sum = 0;
  while (std::getline(in, item, ':')) {
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    HDDP_CHECK_AS(ConfigError,
                  !item.empty() && end != nullptr && *end == '\0' && std::isfinite(v) && v >= 0,
                  "what-if: --shard-by '", text, "': '", item,
                  "' is not a number >= 0. Give memory, equal, or one ratio per device of the "
                  "mix (1:3)");
    rule.ratios.push_back(v);
    sum += v;
  }
  HDDP_CHECK_AS(ConfigError, !rule.ratios.empty() && sum > 0, "what-if: --shard-by '", text,
                "': give memory, equal, or one ratio per device of the mix, not all 0 (1:3)");
  return rule;
}

std::vector<double> sharesFor(const std::vector<MixEntry>& mix, const ModelProfile& p,
                              const WhatIfSettings& s, const ShardRule& rule) {
  std::vector<double> shares(mix.size(), 1.0);
  if (s.zero == 0 || mix.size() <= 1) {
    return shares;
  }
  std::vector<double> weights(mix.size(), 1.0);
  if (rule.kind == ShardRule::Kind::Ratios) {
    weights = rule.ratios;
  } else if (rule.kind == ShardRule::Kind::Memory) {
    // The free memory after the model the Trainer measures; ZeRO-1 keeps a buffer for
    // every gradient on every device, which is not free for the shard either.
    const double model = p.parameterBytes * (s.zero == 1 ? 2.0 : 1.0);
    for (size_t i = 0; i < mix.size(); ++i) {
      weights[i] = std::max(0.0, mix[i].device.memoryGiB * kGiB - s.contextBytes - model);
    }
  }
  double sum = 0.0;
  for (double w : weights) {
    sum += w;
  }
  HDDP_CHECK_AS(ConfigError, sum > 0, "what-if: no device of the mix has memory left for a ZeRO-",
                s.zero, " shard after ", gib(p.parameterBytes), " GiB of weights",
                s.zero == 1 ? " and as much of gradients" : "", " of ", p.model,
                ": use --amp, a smaller model, or larger devices");
  for (size_t i = 0; i < mix.size(); ++i) {
    shares[i] = weights[i] / sum;
  }
  return shares;
}

void checkZero(const std::vector<MixEntry>& mix, const WhatIfSettings& s, const ShardRule& rule) {
  HDDP_CHECK_AS(ConfigError, s.zero >= 0 && s.zero <= 2, "what-if: --zero is ", s.zero,
                "; give 0 (plain data parallelism), 1 (optimizer state sharded) or 2 (and "
                "gradients)");
  if (s.zero == 0) {
    return;
  }
  HDDP_CHECK_AS(ConfigError,
                rule.kind != ShardRule::Kind::Ratios || rule.ratios.size() == mix.size(),
                "what-if: --shard-by ", s.shardBy, " gives ", rule.ratios.size(), " ratios for ",
                mix.size(), " devices in the mix; give one per device");
  if (s.compression != "auto") {
    const auto spec = CompressionSpec::parse(s.compression, "what-if");
    HDDP_CHECK_AS(ConfigError, spec.kind == CompressionSpec::Kind::None, "what-if: ZeRO (--zero ",
                  s.zero,
                  ") reduces each gradient bucket to the device that owns it and cannot "
                  "be combined with gradient compression (--compress ",
                  s.compression, "); drop --compress or use --zero 0");
  }
}

void setCaps(std::vector<RankCost>& costs, const std::vector<MixEntry>& mix, const ModelProfile& p,
             const WhatIfSettings& s, const std::vector<double>& shares) {
  for (size_t i = 0; i < mix.size(); ++i) {
    costs[i].maxSamples =
        MemoryEstimator::capFor(memoryFit(mix[i].device, p, s, shares[i]), s.memoryHeadroom);
  }
}

}  // namespace what_if_detail
}  // namespace hddp
