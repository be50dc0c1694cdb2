// What-if planning (hddp/balance/what_if.h): each device's costs from the device table and
// a model's profile, the prediction of a mix with the planner's own solver, and its advice.
// The step and allreduce model is in what_if_step.cpp, the memory rules in
// what_if_memory.cpp.
#include "hddp/balance/what_if.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "hddp/balance/compression_model.h"
#include "hddp/balance/cost_model.h"
#include "hddp/balance/memory_model.h"
#include "hddp/core/error.h"
#include "what_if_memory.h"
#include "what_if_step.h"

namespace hddp {

// The memory rules, split out into what_if_memory.cpp.
using what_if_detail::checkZero;
using what_if_detail::footprint;
using what_if_detail::Footprint;
using what_if_detail::kGiB;
using what_if_detail::kMiB;
using what_if_detail::kNoCap;
using what_if_detail::memoryFit;
using what_if_detail::parseShardRule;
using what_if_detail::setCaps;
using what_if_detail::ShardRule;
using what_if_detail::sharesFor;

// The step model, split out into what_if_step.cpp.
using what_if_detail::aloneSamplesPerSecond;
using what_if_detail::chooseTraffic;
using what_if_detail::plainTraffic;
using what_if_detail::solvedStep;
using what_if_detail::Step;
using what_if_detail::stepFor;
using what_if_detail::Traffic;

namespace {

using json = nlohmann::json;
std::string format(const char* fmt, double a, double b = 0, double c = 0, double d = 0) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), fmt, a, b, c, d);
  return buf;
}

std::string percent(double fraction) { return format("%.0f%%", 100.0 * fraction); }

// "12% more than" / "18% less than": `mine` against `other`.
std::string compared(double mine, double other) {
  return mine >= other ? percent(mine / other - 1.0) + " more than"
                       : percent(1.0 - mine / other) + " less than";
}

std::string label(const MixEntry& e) { return e.device.key + " on " + e.link.key; }

std::string capText(int64_t cap) { return cap == kNoCap ? "no cap" : std::to_string(cap); }

const char* precisionName(AmpMode amp) { return amp == AmpMode::Off ? "fp32" : ampModeName(amp); }

}  // namespace

std::vector<double> stateShares(const std::vector<MixEntry>& mix, const ModelProfile& p,
                                const WhatIfSettings& s) {
  const ShardRule rule = parseShardRule(s.shardBy);
  checkZero(mix, s, rule);
  return sharesFor(mix, p, s, rule);
}

double peakTflopsFor(const DeviceSpec& d, AmpMode amp) {
  const double rate = amp == AmpMode::Fp16 ? d.fp16Tflops : amp == AmpMode::Bf16 ? d.bf16Tflops : 0;
  return rate > 0 ? rate : d.fp32Tflops;
}

std::vector<RankCost> whatIfCosts(const std::vector<MixEntry>& mix, const ModelProfile& p,
                                  const WhatIfSettings& s, const DeviceTable& table) {
  HDDP_CHECK_AS(ConfigError, !mix.empty(), "what-if: the mix names no device");
  HDDP_CHECK_AS(ConfigError, s.globalBatch > 0, "what-if: the global batch must be positive, not ",
                s.globalBatch);
  const bool calibrated = !p.calibratedOn.empty();
  HDDP_CHECK_AS(ConfigError,
                calibrated ? p.calibratedSecondsPerSample > 0 : p.trainFlopsPerSample > 0,
                "what-if: the profile of ", p.model,
                calibrated ? " has no measured seconds per sample"
                           : " counts no training FLOPs: calibrate it on a device (--calibrate)");
  HDDP_CHECK_AS(ConfigError, s.efficiency > 0 && s.efficiency <= 1,
                "what-if: the efficiency is a share of the peak in (0, 1], not ", s.efficiency);
  HDDP_CHECK_AS(ConfigError, s.memoryTraffic >= 0 && std::isfinite(s.memoryTraffic),
                "what-if: the memory traffic is bytes moved per activation byte, 0 or more, not ",
                s.memoryTraffic);
  const std::vector<double> shares = stateShares(mix, p, s);
  std::vector<RankCost> costs;
  for (const auto& e : mix) {
    RankCost c;
    const double peak = peakTflopsFor(e.device, p.amp);
    if (calibrated) {
      const DeviceSpec& k = table.device(p.calibratedOn);
      c.secondsPerSample = p.calibratedSecondsPerSample * peakTflopsFor(k, p.amp) / peak;
      c.fixedSeconds = p.calibratedFixedSeconds * k.memoryGBps / e.device.memoryGBps;
    } else {
      c.secondsPerSample =
          p.trainFlopsPerSample / (peak * 1e12 * s.efficiency) +
          s.memoryTraffic * p.activationBytesPerSample / (e.device.memoryGBps * 1e9);
      c.fixedSeconds =
          (3.0 + 2.0 * s.optimizerStateCopies) * p.parameterBytes / (e.device.memoryGBps * 1e9);
    }
    c.bytesPerSample = p.inputBytesPerSample;
    c.linkBytesPerSecond = e.link.GBps * 1e9;
    c.transferOverlapped = s.prefetch;
    costs.push_back(c);
  }
  setCaps(costs, mix, p, s, shares);
  return costs;
}

WhatIfResult predictMix(const std::vector<MixEntry>& mix, const ModelProfile& p,
                        const WhatIfSettings& s, const DeviceTable& table) {
  const std::vector<RankCost> costs = whatIfCosts(mix, p, s, table);
  const ShardRule rule = parseShardRule(s.shardBy);
  const std::vector<double> shares = sharesFor(mix, p, s, rule);
  const int64_t B = s.globalBatch;
  int64_t room = 0;
  for (const auto& c : costs) {
    room = c.maxSamples == kNoCap || room == kNoCap ? kNoCap : room + c.maxSamples;
  }
  HDDP_CHECK_AS(ConfigError, room >= B, "what-if: the mix's memory holds ", room, " samples of ",
                p.model, " per step, fewer than the global batch of ", B,
                ": lower --global-batch, use --amp, or add a device");

  WhatIfResult r;
  const Traffic traffic = chooseTraffic(mix, costs, p, s, r);
  const Step step = solvedStep(costs, B, traffic, s);
  r.plan = step.plan;
  r.allreduceSeconds = step.allreduce;
  r.exposedAllreduceSeconds = step.exposed;
  r.slowestLinkGBps = step.slowestLinkBytesPerSecond / 1e9;
  r.stepSeconds = step.seconds;
  r.samplesPerSecond = static_cast<double>(B) / step.seconds;
  for (size_t i = 0; i < mix.size(); ++i) {
    WhatIfDevice d;
    d.entry = mix[i];
    d.cost = costs[i];
    d.local = r.plan.local[i];
    d.memoryCap = costs[i].maxSamples;
    d.peakTflops = peakTflopsFor(mix[i].device, p.amp);
    d.computeSeconds = costs[i].secondsPerSample * static_cast<double>(d.local);
    d.transferSeconds = costs[i].transferSecondsPerSample() * static_cast<double>(d.local);
    d.stepSeconds = costs[i].predict(d.local);
    const Footprint f = footprint(p, s, shares[i]);
    d.parameterBytes = f.parameters;
    d.gradientBytes = f.gradients;
    d.stateBytes = f.state;
    d.activationBytes = p.activationBytesPerSample * static_cast<double>(d.local);
    d.shareOfState = shares[i];
    d.memoryBytes = f.fixed() + d.activationBytes;
    r.devices.push_back(d);
  }

  // Peers: PyTorch DDP's equal split, and the fastest card alone.
  const BatchPlan equal = equalSplit(static_cast<int>(costs.size()), B);
  std::string overflow;
  for (size_t i = 0; i < costs.size(); ++i) {
    if (equal.local[i] > costs[i].maxSamples && overflow.empty()) {
      overflow =
          format("%.0f samples where its memory holds %.0f", static_cast<double>(equal.local[i]),
                 static_cast<double>(costs[i].maxSamples));
      overflow = mix[i].device.key + " " + overflow;
    }
  }
  if (overflow.empty()) {
    r.equalSplitSamplesPerSecond =
        static_cast<double>(B) / stepFor(costs, equal.local, traffic, s).seconds;
  }
  for (size_t i = 0; i < costs.size(); ++i) {
    // Alone, a device holds all of what ZeRO would shard.
    RankCost whole = costs[i];
    whole.maxSamples =
        MemoryEstimator::capFor(memoryFit(mix[i].device, p, s, 1.0), s.memoryHeadroom);
    const double alone = aloneSamplesPerSecond(whole, B);
    if (alone > r.fastestAloneSamplesPerSecond) {
      r.fastestAloneSamplesPerSecond = alone;
      r.fastest = static_cast<int>(i);
    }
  }

  // Advice, most telling first.
  auto& advice = r.advice;
  if (mix.size() > 1) {
    std::string line = format("hddp's split trains %.0f samples/s", r.samplesPerSecond);
    if (r.equalSplitSamplesPerSecond > 0) {
      line += ", " + compared(r.samplesPerSecond, r.equalSplitSamplesPerSecond) +
              format(" PyTorch DDP's equal split (%.0f samples/s)", r.equalSplitSamplesPerSecond);
    } else {
      line += "; PyTorch DDP's equal split would run out of memory (" + overflow + ")";
    }
    line += ", " + compared(r.samplesPerSecond, r.fastestAloneSamplesPerSecond) + " the " +
            mix[static_cast<size_t>(r.fastest)].device.key +
            format(" alone (%.0f samples/s)", r.fastestAloneSamplesPerSecond);
    advice.push_back(line);
    // What each device adds to the others.
    for (size_t i = 0; i < mix.size(); ++i) {
      std::vector<RankCost> rest = costs;
      rest.erase(rest.begin() + static_cast<std::ptrdiff_t>(i));
      double restRate = 0.0;
      try {
        if (s.zero > 0) {
          // The others share the shards out between them: each holds more.
          std::vector<MixEntry> others = mix;
          others.erase(others.begin() + static_cast<std::ptrdiff_t>(i));
          ShardRule otherRule = rule;
          if (rule.kind == ShardRule::Kind::Ratios) {
            otherRule.ratios.erase(otherRule.ratios.begin() + static_cast<std::ptrdiff_t>(i));
          }
          setCaps(rest, others, p, s, sharesFor(others, p, s, otherRule));
        }
        restRate =
            static_cast<double>(B) / (rest.size() == 1 ? B / aloneSamplesPerSecond(rest[0], B)
                                                       : solvedStep(rest, B, traffic, s).seconds);
      } catch (const ConfigError&) {
        restRate = 0.0;  // the others cannot hold the batch
      }
      if (restRate <= 0) {
        advice.push_back("without the " + label(mix[i]) +
                         " the other devices' memory cannot hold the global batch");
      } else if (r.samplesPerSecond >= restRate) {
        advice.push_back("the " + label(mix[i]) + " adds " +
                         percent(r.samplesPerSecond / restRate - 1.0) + " to the rest of the mix");
      } else {
        advice.push_back("the " + label(mix[i]) + " slows the rest of the mix by " +
                         percent(1.0 - r.samplesPerSecond / restRate) +
                         " (its link's allreduce costs more than its compute gives): leave it out");
      }
    }
  }
  // Links slower than the mix's fastest: what they cost, and whether prefetch hides them.
  double fastestLink = 0.0;
  for (const auto& c : costs) {
    fastestLink = std::max(fastestLink, c.linkBytesPerSecond);
  }
  for (size_t i = 0; i < mix.size(); ++i) {
    const auto& c = costs[i];
    if (c.linkBytesPerSecond >= fastestLink && mix.size() > 1) {
      continue;
    }
    std::vector<RankCost> better = costs;
    better[i].linkBytesPerSecond = mix.size() > 1 ? fastestLink : 0.0;
    const double ideal = solvedStep(better, B, traffic, s).seconds;
    const double t = c.transferSecondsPerSample();
    std::string line =
        "with this model the " + mix[i].link.key + " link of the " + mix[i].device.key + " costs " +
        percent(r.stepSeconds / ideal - 1.0) +
        (mix.size() > 1 ? " against the fastest link" : " against an unlimited link") +
        format(": input copies %.3f ms/sample", t * 1e3);
    if (c.transferOverlapped && t <= c.secondsPerSample) {
      line += format(", hidden by prefetch behind %.3f ms of compute", c.secondsPerSample * 1e3);
    } else if (c.transferOverlapped) {
      line += format(", more than its %.3f ms of compute: prefetch cannot hide them",
                     c.secondsPerSample * 1e3);
    } else {
      line += format(", added to its %.3f ms of compute (no prefetch)", c.secondsPerSample * 1e3);
    }
    if (c.linkBytesPerSecond == step.slowestLinkBytesPerSecond && r.allreduceSeconds > 0) {
      line += format(
          "; the gradient allreduce over it takes %.1f ms per step, %.1f ms of it "
          "exposed after backward",
          r.allreduceSeconds * 1e3, r.exposedAllreduceSeconds * 1e3);
    }
    advice.push_back(line);
  }
  // Gradient compression: what the choice saves against the plain allreduce.
  if (mix.size() > 1 && r.compression.spec.kind != CompressionSpec::Kind::None) {
    const double plain =
        static_cast<double>(B) / solvedStep(costs, B, plainTraffic(p.parameterBytes, s), s).seconds;
    advice.push_back(
        "with " + r.compression.spec.name() +
        format(" compression the allreduce carries %.3g MB per step instead of %.3g MB, "
               "%.1f ms of it exposed and %.1f ms of compression compute: ",
               r.compression.wireBytes / 1e6, p.parameterBytes / 1e6,
               (r.compression.exposedSeconds - r.compression.computeSeconds) * 1e3,
               r.compression.computeSeconds * 1e3) +
        format("%.0f samples/s, ", r.samplesPerSecond) + compared(r.samplesPerSecond, plain) +
        format(" the plain allreduce's %.0f", plain));
  }
  if (!r.compressionWhy.empty()) {
    advice.push_back("--compress auto would choose " + r.compressionWhy);
  }
  if (s.zero > 0 && s.compression == "auto") {
    advice.push_back(format("ZeRO-%.0f sends each gradient bucket whole to its owner: ", s.zero) +
                     "--compress auto chooses none, as the Trainer does");
  }
  if (s.zero > 0 && mix.size() > 1) {
    // Who holds how much, and what it buys against plain data parallelism.
    WhatIfSettings plain = s;
    plain.zero = 0;
    std::string held;
    std::string caps;
    std::string plainCaps;
    for (size_t i = 0; i < mix.size(); ++i) {
      const auto& d = r.devices[i];
      const double sharded = d.stateBytes + (s.zero == 2 ? d.gradientBytes : 0.0);
      held += std::string(i == 0 ? "the " : ", the ") + mix[i].device.key + " " +
              percent(d.shareOfState) + format(" (%.2f GiB)", sharded / kGiB);
      const int64_t plainCap =
          MemoryEstimator::capFor(memoryFit(mix[i].device, p, plain, 1.0), s.memoryHeadroom);
      caps += (i == 0 ? "" : ", ") + capText(d.memoryCap);
      plainCaps += (i == 0 ? "" : ", ") + capText(plainCap);
    }
    advice.push_back(
        format("ZeRO-%.0f shards ", s.zero) +
        (s.zero == 2 ? "the optimizer state and the gradients" : "the optimizer state") + " by " +
        (rule.kind == ShardRule::Kind::Ratios ? "--shard-by " + s.shardBy : s.shardBy) + ": " +
        held + "; memory caps " + caps + " samples, against " + plainCaps + " without ZeRO");
  }
  for (size_t i = 0; i < mix.size(); ++i) {
    const auto fit = memoryFit(mix[i].device, p, s, shares[i]);
    const int64_t cap = costs[i].maxSamples;
    const std::string precision =
        p.amp == AmpMode::Off ? "in fp32" : std::string("with ") + ampModeName(p.amp) + " AMP";
    if (cap == 0) {
      advice.push_back("the " + mix[i].device.key +
                       format(" (%.0f GiB) cannot hold the model ", mix[i].device.memoryGiB) +
                       precision +
                       format(": %.2f GiB of weights, gradients and optimizer state, %.0f MiB "
                              "per sample",
                              fit.fixedBytes / kGiB, fit.perSampleBytes / kMiB) +
                       (s.zero > 0 ? format(" (with its ZeRO-%.0f shard, %.0f%% of the state)",
                                            s.zero, 100.0 * shares[i])
                                   : std::string()));
    } else if (cap != kNoCap && r.plan.local[i] == cap && cap < B) {
      advice.push_back("memory caps the " + mix[i].device.key +
                       format(" at %.0f samples ", static_cast<double>(cap)) + precision +
                       format(" (%.0f GiB: %.2f GiB fixed + %.1f MiB per sample, ",
                              mix[i].device.memoryGiB, fit.fixedBytes / kGiB,
                              fit.perSampleBytes / kMiB) +
                       percent(s.memoryHeadroom) + " kept free)");
    }
    if (p.amp != AmpMode::Off && peakTflopsFor(mix[i].device, p.amp) == mix[i].device.fp32Tflops &&
        (p.amp == AmpMode::Fp16 ? mix[i].device.fp16Tflops : mix[i].device.bf16Tflops) <= 0) {
      const bool fp16 = mix[i].device.fp16Tflops > 0;
      advice.push_back(
          "the " + mix[i].device.key + " has no " + ampModeName(p.amp) +
          " tensor path: predicted at its fp32 rate" +
          format(" (%.1f TFLOPS)", mix[i].device.fp32Tflops) +
          (fp16 ? format("; --amp fp16 would use its %.1f TFLOPS", mix[i].device.fp16Tflops)
                : std::string()));
    }
  }
  if (p.calibratedOn.empty()) {
    advice.push_back("not calibrated: compute is predicted at " + percent(s.efficiency) +
                     " of each card's " + precisionName(p.amp) + " peak plus " +
                     format("%.1f", s.memoryTraffic) +
                     " bytes of memory traffic per activation byte (--efficiency, "
                     "--memory-traffic), a fit to published training figures within +/-" +
                     percent(s.uncertainty) +
                     "; a calibration on a card of the table (--calibrate) replaces that guess "
                     "with a measurement");
  }
  return r;
}

}  // namespace hddp
