// What-if's memory rules (src/balance/what_if.cpp): what a device holds with its share
// of what ZeRO shards, and the shares by --shard-by. Internal to the balance layer.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "hddp/balance/cost_model.h"
#include "hddp/balance/memory_model.h"
#include "hddp/balance/what_if.h"

namespace hddp {
namespace what_if_detail {

constexpr int64_t kNoCap = std::numeric_limits<int64_t>::max();
constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kGiB = 1024.0 * kMiB;

// What a device holds whatever its batch, with `share` of what ZeRO shards: the weights
// whole, the gradients (sharded under ZeRO-2) and the optimizer state (under ZeRO-1 and 2).
// The gradients are the fp32 parameters' bytes, as the plain rule counts them.
struct Footprint {
  double parameters = 0.0;
  double gradients = 0.0;
  double state = 0.0;
  double fixed() const { return parameters + gradients + state; }
};

Footprint footprint(const ModelProfile& p, const WhatIfSettings& s, double share);

MemoryEstimator::Fit memoryFit(const DeviceSpec& d, const ModelProfile& p, const WhatIfSettings& s,
                               double share);

// WhatIfSettings::shardBy, parsed: the text the trainers' --shard-by takes, with the
// messages of hddp::parseShardBy (the ddp layer, above this one; the tests hold the two to
// the same answers).
struct ShardRule {
  enum class Kind { Memory, Equal, Ratios };
  Kind kind = Kind::Memory;
  std::vector<double> ratios;
};

ShardRule parseShardRule(const std::string& text);

// Each device's share of what ZeRO shards (see what_if.h); one device holds all.
std::vector<double> sharesFor(const std::vector<MixEntry>& mix, const ModelProfile& p,
                              const WhatIfSettings& s, const ShardRule& rule);

// A ConfigError for a --zero/--shard-by that the mix or the compression rules out.
void checkZero(const std::vector<MixEntry>& mix, const WhatIfSettings& s, const ShardRule& rule);

// The caps of `costs`' devices with `shares` of what ZeRO shards.
void setCaps(std::vector<RankCost>& costs, const std::vector<MixEntry>& mix, const ModelProfile& p,
             const WhatIfSettings& s, const std::vector<double>& shares);

}  // namespace what_if_detail
}  // namespace hddp
