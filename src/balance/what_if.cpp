// What-if planning (hddp/balance/what_if.h): a mix of the device table's cards and links,
// a model's profile, and the planner's own solver and allreduce model.
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

// One step of a set of costs: the split, the allreduce and what of it backward hides.
struct Step {
  BatchPlan plan;
  double allreduce = 0.0;
  double exposed = 0.0;
  double backward = 0.0;  // the slowest rank's, which the buckets go out during
  double slowestLinkBytesPerSecond = 0.0;
  double seconds = 0.0;
};

// The bytes of the bucket backward fills last (the first layers' gradients): DDP's
// buckets in reverse parameter order are a small first one, then full ones, and the
// remainder last.
double lastBucketBytes(double parameterBytes, const WhatIfSettings& s) {
  const double rest = parameterBytes - std::min(parameterBytes, s.firstBucketBytes);
  if (!(rest > 0)) {
    return parameterBytes;
  }
  const double full = std::ceil(rest / s.bucketBytes) - 1.0;
  return rest - full * s.bucketBytes;
}

// What the gradients put on the slowest link per step: the bytes, the share of them in
// the last bucket (it cannot hide behind backward), and the compression's own compute.
struct Traffic {
  double wireBytes = 0.0;
  double lastShare = 1.0;
  double endShare = 0.0;  // sent only after backward (PowerSGD's Q round)
  double computeSeconds = 0.0;
};

Traffic plainTraffic(double parameterBytes, const WhatIfSettings& s) {
  Traffic t;
  t.wireBytes = parameterBytes;
  t.lastShare = parameterBytes > 0 ? lastBucketBytes(parameterBytes, s) / parameterBytes : 1.0;
  return t;
}

Step stepFor(const std::vector<RankCost>& costs, const std::vector<int64_t>& local,
             const Traffic& traffic, const WhatIfSettings& settings) {
  Step s;
  s.plan.local = local;
  for (int64_t b : local) {
    s.plan.global += b;
  }
  s.plan.predictedStepSeconds = predictedSeconds(costs, local);
  for (const auto& c : costs) {
    if (c.linkBytesPerSecond > 0) {
      s.slowestLinkBytesPerSecond =
          s.slowestLinkBytesPerSecond > 0
              ? std::min(s.slowestLinkBytesPerSecond, c.linkBytesPerSecond)
              : c.linkBytesPerSecond;
    }
  }
  if (settings.allreduceGBps > 0) {
    s.slowestLinkBytesPerSecond = settings.allreduceGBps * 1e9;
  }
  s.allreduce = ringAllreduceSeconds(traffic.wireBytes, static_cast<int>(costs.size()),
                                     s.slowestLinkBytesPerSecond);
  // The allreduce follows the slowest rank's backward: that is when its buckets fill.
  size_t slowest = 0;
  for (size_t i = 1; i < costs.size(); ++i) {
    if (costs[i].predict(local[i]) > costs[slowest].predict(local[slowest])) {
      slowest = i;
    }
  }
  s.backward =
      kBackwardShare * costs[slowest].secondsPerSample * static_cast<double>(local[slowest]);
  s.exposed = exposedAllreduceSeconds(s.allreduce, s.backward, traffic.lastShare, traffic.endShare);
  if (costs.size() > 1) {
    s.exposed += traffic.computeSeconds;
  }
  s.seconds = s.plan.predictedStepSeconds + s.exposed;
  return s;
}

Step solvedStep(const std::vector<RankCost>& costs, int64_t globalBatch, const Traffic& traffic,
                const WhatIfSettings& settings) {
  return stepFor(costs, solveSplit(costs, globalBatch).local, traffic, settings);
}

// The whole batch on one device, in micro-batches its memory holds (accumulation).
double aloneSamplesPerSecond(const RankCost& c, int64_t globalBatch) {
  if (c.maxSamples <= 0) {
    return 0.0;
  }
  const int64_t microBatches =
      c.maxSamples >= globalBatch ? 1 : (globalBatch + c.maxSamples - 1) / c.maxSamples;
  const double seconds = static_cast<double>(microBatches) * c.fixedSeconds +
                         static_cast<double>(globalBatch) * c.perSampleSeconds();
  return static_cast<double>(globalBatch) / seconds;
}

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

namespace {

// What WhatIfSettings::compression sends, priced on the mix (for "auto", each candidate
// priced and chosen as the Trainer does); the choice is recorded in `r`.
Traffic chooseTraffic(const std::vector<MixEntry>& mix, const std::vector<RankCost>& costs,
                      const ModelProfile& p, const WhatIfSettings& s, WhatIfResult& r) {
  // Under ZeRO the Trainer turns auto off: each bucket goes to its owner whole.
  const bool choose = s.compression == "auto" && s.zero == 0;
  std::vector<CompressionSpec> specs = choose
                                           ? autoCandidates(p.amp)
                                           : std::vector<CompressionSpec>{CompressionSpec::parse(
                                                 s.zero > 0 ? "none" : s.compression, "what-if")};
  GradientLayout layout;
  layout.shapes = p.gradientShapes;
  layout.firstBucketBytes = s.firstBucketBytes;
  layout.bucketCapBytes = s.bucketBytes;
  std::vector<CompressionCost> priced;
  std::vector<Traffic> traffics;
  LinkBudget link;
  link.ranks = static_cast<int>(mix.size());
  // The gradients: the shapes' bytes where the profile has them (frozen parameters have
  // none), else every parameter's.
  const double gradientBytes = p.gradientShapes.empty() ? p.parameterBytes : layout.bytes();
  for (const auto& spec : specs) {
    // One bucket model for every choice: the last bucket's share by bytes (above).
    Traffic t = plainTraffic(gradientBytes, s);
    CompressionCost c;
    c.spec = spec;
    c.wireBytes = gradientBytes;
    // One allreduce per bucket: the first, then full ones and the remainder.
    const double rest = gradientBytes - std::min(gradientBytes, s.firstBucketBytes);
    c.messages = 1 + static_cast<int>(std::ceil(rest / s.bucketBytes));
    if (spec.kind == CompressionSpec::Kind::Fp16 || spec.kind == CompressionSpec::Kind::Bf16) {
      c.wireBytes = t.wireBytes = gradientBytes / 2.0;
    } else if (spec.kind == CompressionSpec::Kind::PowerSgd) {
      HDDP_CHECK_AS(ConfigError, !p.gradientShapes.empty(), "what-if: pricing PowerSGD needs ",
                    "the gradients' shapes, and the profile of ", p.model,
                    " has none (a profile saved before they were recorded): profile the model "
                    "again (--model, or --save-profile to keep it)");
      c = compressionTraffic(spec, layout);
      t.wireBytes = c.wireBytes;
      t.endShare = c.endShare;
      // Its arithmetic at the products' share of each card's fp32 peak plus its passes
      // over device memory; the slowest card of the mix holds the others up.
      for (const auto& e : mix) {
        t.computeSeconds =
            std::max(t.computeSeconds, c.flops / (e.device.fp32Tflops * 1e12 * s.efficiency) +
                                           c.memoryBytes / (e.device.memoryGBps * 1e9));
      }
    }
    const Step step = solvedStep(costs, s.globalBatch, t, s);
    c.allreduceSeconds = step.allreduce;
    c.computeSeconds = mix.size() > 1 ? t.computeSeconds : 0.0;
    c.exposedSeconds = step.exposed;
    c.hidden = exposesLittle(c.exposedSeconds, step.backward);
    link.bytesPerSecond = step.slowestLinkBytesPerSecond;
    link.backwardSeconds = step.backward;
    priced.push_back(c);
    traffics.push_back(t);
  }
  const CompressionDecision d = chooseCompression(priced, link);
  r.compression = d.chosen;
  if (choose) {
    r.compressionCandidates = d.candidates;
    r.compressionWhy = d.why;
  }
  for (size_t k = 0; k < priced.size(); ++k) {
    if (priced[k].spec.name() == d.chosen.spec.name()) {
      return traffics[k];
    }
  }
  return traffics.front();
}

}  // namespace

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
