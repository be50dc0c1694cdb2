// What-if's step model (what_if_step.h): a split's step time with its exposed allreduce,
// the gradients' traffic by bucket, and the compression priced and chosen on the mix.
#include "what_if_step.h"

#include <algorithm>
#include <cmath>

#include "hddp/balance/compression_model.h"
#include "hddp/balance/cost_model.h"
#include "hddp/core/error.h"

namespace hddp {
namespace what_if_detail {
namespace {

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

}  // namespace

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

}  // namespace what_if_detail
}  // namespace hddp
